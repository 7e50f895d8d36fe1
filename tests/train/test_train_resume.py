"""`memstep train-draft --init PATH` trains a saved head further: it starts from the saved
matrices (at learning rate 0 they come back unchanged), keeps their shapes and draft
vocabulary whatever the flags say, counts every run's answers, and refuses a head made for
another target before loading it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memstep.cli.main import main
from memstep.core.model_source import model_config, resolve
from memstep.executors.spec.eagle import CONTEXT, AttnShape, init_params, save_head
from memstep.train.fit import fit
from memstep.train.saved_head import HeadMismatch, read_head


def arrays(path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def saved_smollm2_head(path, intermediate: int = 64) -> None:
    """A fresh head with attention for SmolLM2, saved as train-draft saves one."""
    mc = model_config(resolve("smollm2"))
    shape = (mc.num_heads, mc.num_kv_heads, mc.head_dim, int(mc.rope_theta), CONTEXT)
    params = init_params(mc.hidden_size, intermediate, 7, AttnShape(*shape))
    names = ("heads", "kv_heads", "head_dim", "rope_theta", "window")
    meta = {"hidden": mc.hidden_size, "vocab": mc.vocab_size, "intermediate": intermediate}
    meta |= dict(zip(names, shape, strict=True)) | {"prompt_context": 1, "answers": 40}
    save_head(path, params, torch.arange(2, 300), meta)


def test_fitting_starts_from_the_saved_parameters(tmp_path):
    path = tmp_path / "head.npz"
    saved_smollm2_head(path)
    head = read_head(path, 576, 49152)
    assert head.intermediate == 64 and head.attn is not None and head.reads_prompt
    embed = torch.randn(300, 576) * 0.02  # the tokens the exchange holds, no more
    rows = 12
    data = ([torch.randn(rows, 576)], [torch.randint(2, 300, (rows,))], [], [0])
    data = (data[0], data[1], [data[1][0].roll(-1)], [0])
    common = dict(intermediate=8, passes=2, epochs=2, batch=4, weight_decay=0.0, seed=0)
    args = (data, embed, embed[head.vocab], head.vocab, 1e-5, head.attn)
    still = fit(*args, init=head.params, lr=0.0, feature_weight=0.5, **common, log=lambda _: 0)
    moved = fit(*args, init=head.params, lr=1e-2, feature_weight=0.5, **common, log=lambda _: 0)
    for name, value in head.params.items():
        assert torch.equal(still[name], value), f"{name} did not start from the file"
    assert any(not torch.equal(moved[n], v) for n, v in head.params.items()), "nothing trained"


def test_train_draft_init_keeps_the_saved_shapes_and_counts_the_answers(tmp_path):
    first, further = tmp_path / "first.npz", tmp_path / "further.npz"
    saved_smollm2_head(first)
    argv = ["train-draft", "--init", str(first), "--skip", "2", "--conversations", "2"]
    # flags that would shape a new head otherwise: the saved head's shapes win
    argv += ["--max-tokens", "8", "--epochs", "2", "--draft-vocab", "64", "--intermediate", "32"]
    assert main([*argv, "--out", str(further)]) == 0
    saved, trained = arrays(first), arrays(further)
    matrices = [n for n in saved if not n.startswith("meta_") and n != "vocab"]
    assert "q" in matrices and "gate_up" in matrices
    assert all(trained[n].shape == saved[n].shape for n in matrices)
    assert any(not np.array_equal(trained[n], saved[n]) for n in matrices), "no training done"
    assert np.array_equal(trained["vocab"], saved["vocab"])
    assert int(trained["meta_answers"]) == 40 + 1  # 2 read, 1 held out


def test_a_head_for_another_target_is_refused(tmp_path):
    path = tmp_path / "other.npz"
    params = {n: torch.zeros(4, 4) for n in ("fc", "mlp_norm", "gate_up", "down", "out_norm")}
    save_head(path, params, torch.arange(8), {"hidden": 4, "vocab": 100, "intermediate": 2})
    assert read_head(path, 4, 100).intermediate == 2
    with pytest.raises(HeadMismatch, match="hidden size 4 and vocabulary 100"):
        read_head(path, 576, 49152)
    argv = ["train-draft", "--init", str(path), "--conversations", "2"]
    assert main([*argv, "--out", str(tmp_path / "never.npz")]) == 2
    assert not (tmp_path / "never.npz").exists()
