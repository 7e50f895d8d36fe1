"""The core process's answers that change nothing: a prompt read as the engine will read it,
tokenize, health and stats, from the engine's snapshot (`Engine.snapshot`).  `Answers` is a part
of `Server`."""

from __future__ import annotations

import collections
import os
import time

from memstep.core.prompt_checks import outside_vocabulary
from memstep.core.sampling_params import InvalidRequest
from memstep.core.snapshot import EngineSnapshot
from memstep.events.version import VERSION
from memstep.events.wire import (
    PROTOCOL_VERSION,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    StatsReply,
    StatsRequest,
    TokenizeReply,
    TokenizeRequest,
)
from memstep.replay.recorder import Recorder
from memstep.serving.core_config import ServerConfig
from memstep.serving.core_replies import Replies
from memstep.serving.tally import Tally, host_rss_bytes


class Answers(Replies):
    """Tokenize, health and stats replies."""

    cfg: ServerConfig
    recorder: Recorder | None
    started: float
    tally: Tally
    refused: collections.Counter[str]

    def _log_blocks(self) -> bool:
        raise NotImplementedError  # the server's loop

    def _prompt(self, msg: GenerateRequest | TokenizeRequest) -> str | list[int]:
        """Text or token ids; chat messages become ids here, so their text stays plain text; a
        text's or a chat's ids with the tokenizer's special tokens where `add_special_tokens`."""
        ids = msg.prompt_token_ids if isinstance(msg, GenerateRequest) else msg.token_ids
        given = [x for x in (msg.prompt, ids, msg.messages) if x is not None]
        if len(given) != 1:
            what = "prompt_token_ids" if isinstance(msg, GenerateRequest) else "token_ids"
            raise InvalidRequest(f"give exactly one of prompt, {what}, messages")
        extra = msg.chat_template_kwargs
        if any(not isinstance(key, str) for key in extra):
            raise InvalidRequest("chat_template_kwargs must map names (strings) to values")
        tok = self.engine.tokenizer
        if msg.messages is None:
            if extra:
                raise InvalidRequest("chat_template_kwargs goes with messages only")
            if msg.add_special_tokens and isinstance(given[0], str):
                return tok.with_special_tokens(tok.encode(given[0]))
            return given[0]
        if not msg.messages:
            raise InvalidRequest("messages is empty")
        if any(set(m) != {"role", "content"} for m in msg.messages):
            raise InvalidRequest("every message needs exactly the keys 'role' and 'content'")
        ids = tok.encode_chat(msg.messages, msg.special_tokens_in_messages, extra)
        return tok.with_special_tokens(ids) if msg.add_special_tokens else ids

    def _tokenize(self, msg: TokenizeRequest) -> TokenizeReply:
        """A prompt's token ids as a generate request would read it, or token ids' text."""
        tok, vocab, max_len = self.engine.tokenizer, self.facts.vocab_size, self.facts.max_model_len
        if msg.tokenizer_info:
            config = tok.hf_config() | {"model_max_length": max_len}
            return TokenizeReply(msg.request_id, [], "", max_len, config)
        prompt = self._prompt(msg)
        if isinstance(prompt, str):
            ids, text = tok.encode(prompt), prompt
        else:
            bad = outside_vocabulary(prompt, vocab)
            if bad is not None:
                raise InvalidRequest(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
            ids, text = list(prompt), tok.decode(list(prompt))
        return TokenizeReply(msg.request_id, ids, text, max_len)

    def _health(self, msg: HealthRequest) -> HealthReply:
        dead, snap = self.executor_death, self.engine.snapshot()
        status = "dead" if dead else "recovering" if snap.is_recovering else "ok"
        log_failure = self.recorder.failure if self.recorder is not None else None
        if status == "ok" and self._log_blocks():
            status, dead = "log_unwritable", f"the event log cannot be written: {log_failure}"
        elif log_failure is not None:
            dead = dead or f"the event log cannot be written (records dropped): {log_failure}"
        return HealthReply(
            request_id=msg.request_id,
            status=status,
            executor_alive=not (self.executor_death or snap.is_recovering),
            executor_pid=snap.executor_pid,
            core_pid=os.getpid(),
            model=snap.facts.model,
            max_model_len=snap.facts.max_model_len,
            vocab_size=snap.facts.vocab_size,
            max_frame_bytes=self.cfg.max_frame_bytes,
            uptime_s=time.monotonic() - self.started,
            memstep_version=VERSION,
            protocol=PROTOCOL_VERSION,
            detail=dead or ("a new executor is starting" if status == "recovering" else ""),
        )

    def _stats(self, msg: StatsRequest) -> StatsReply:
        snap = self.engine.snapshot()
        return StatsReply(
            request_id=msg.request_id,
            num_running=snap.num_running,
            num_waiting=snap.num_waiting,
            num_inflight=len(self.inflight),
            num_clients=len({inf.peer for inf in self.inflight.values()}),
            step=snap.step,
            step_kind=snap.kind,
            kv_pages_total=snap.kv_pages_total,
            kv_pages_used=snap.kv_pages_used,
            memory=snap.memory,
            finished=dict(self.finished),
            kv_pages_cached=snap.kv_pages_cached,
            prompt_tokens=self.tally.prompt_tokens,
            generation_tokens=self.tally.generation_tokens,
            num_preemptions=snap.num_preemptions,
            num_requeues=snap.num_requeues,
            num_leak_reports=self.tally.num_leak_reports,
            steps=dict(self.tally.steps),
            transitions=dict(self.tally.transitions),
            host_rss_bytes=host_rss_bytes(self._pids(snap)),
            refused=dict(self.refused),
        )

    def _pids(self, snap: EngineSnapshot) -> dict[str, int]:
        pids = {"core": os.getpid(), "executor": snap.executor_pid, "standby": snap.standby_pid}
        return {name: pid for name, pid in pids.items() if pid}
