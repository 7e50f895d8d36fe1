"""Shared fixtures: the real default model is loaded once per test session."""

from __future__ import annotations

import gc
import os

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports triton: see test_kernels.py
    os.environ.setdefault("TRITON_INTERPRET", "1")

from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.executors.process.inprocess import local_engine

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one paragraph.",
    "List three prime numbers.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "Give me a tip for learning to play the guitar as an adult who has never played music.",
    "Why is the sky blue?",
]


@pytest.fixture(autouse=True)
def _gpu_memory_given_back(request):
    """After each `-m gpu` test, this process's CUDA memory back to the device: an in-process
    engine's KV cache takes most of the GPU, and the allocator would keep it cached for a later
    test's own processes (a replica, a served executor) to miss."""
    yield
    if request.node.get_closest_marker("gpu") is not None and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def smol_engine() -> Engine:
    """SmolLM2-135M-Instruct in float32, unquantized (HF parity is exact), default limits."""
    return local_engine(EngineConfig(model="smollm2", dtype="float32", quantization="none"))


@pytest.fixture(scope="session")
def fp8_smol_engine() -> Engine:
    """The same model and limits with an fp8 KV cache."""
    cfg = EngineConfig(model="smollm2", dtype="float32", quantization="none", kv_cache_dtype="fp8")
    return local_engine(cfg)


@pytest.fixture(scope="session")
def chat_prompts(smol_engine: Engine) -> list[list[int]]:
    tok = smol_engine.tokenizer
    return [tok.encode_chat([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS]
