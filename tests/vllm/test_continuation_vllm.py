"""No token lost, on real vLLM (issue 41): a greedy generation whose engine is drained, quarantined by a
refit or killed with SIGKILL mid-generation goes on on the other engine, and the client's answer is the
uninterrupted one; a keep-mode refit during a long generation gives the answer per-token version spans
that match the pause the refit reported.

Two real vLLM CPU engines (the paced model: the tiny model's tokenizer, a float32 model one core
decodes at 6 to 16 ms a token, its engine core behind the API server, so that the router reads as fast
as the engine makes tokens and a cut lands in the middle of a generation; keyed, dev routes on:
``tests/support/vllm_calls.dev_engine``), one core each, behind a real router with its default
continuation settings and a record. Every scenario sends the same four requests at once, completions and
chat, streamed and not, each asking for token ids and logprobs, all on one engine (a session header the
consistent-hash policy maps there): first uninterrupted (the reference), then again with the engine
taken away once they have produced part of their answers. The answers must be the
reference's: the same token ids, text, finish reason, usage and one answer id; logprobs within
``LOGPROB_TOLERANCE`` (measured, tests/support/continuation_calls.py); the record shows the move (from,
to, at which token, why), and the other engine generated only the tokens that were left (nothing
regenerated). The tests run in file order on the module's engines: the kill is last.

Needs ``RL_LAUNCH_VLLM_PYTHON``; alone, as the other vLLM tests (two engines take two cores)::

    .venv/bin/python -m pytest -n 0 -q -s tests/vllm/test_continuation_vllm.py
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import threading
import time
import uuid
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.engines.base import EngineStartError
from launcher.engines.vllm.engine import VllmEngine
from launcher.fleet.client import FleetClient
from router import GenerationRouter, RouterConfig
from router.continuation.spans import parse_header
from tests.support.continuation_calls import (
    CHAT,
    COMPLETIONS,
    Answer,
    body,
    call,
    differences,
    engine_completion,
    engine_counter,
    in_thread,
    pending_before,
    record_line,
)
from tests.support.engine_key_probes import KEY
from tests.support.shared_vllm import start_all
from tests.support.vllm_calls import _perturbed_copy, _until, dev_engine, generation_behind_serving

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]
TOKEN = "continuation-admin-token-4411"
MAX_TOKENS = 800
"""The moved answers' length (5 to 12 s on the paced model): long enough that the engine is still
generating when the streams have ``CUT_AFTER`` tokens and the test takes it away; short enough that a cut
answer's logprobs, carried over through a prefill instead of decodes, stay within the tolerance."""
CUT_AFTER = 100
"""The tokens both streamed answers have when their engine is taken away (the whole ones, sent at the same
moment, about as many): far enough in that a move carries a real prefix over, far enough from the end
(about 6 s of the paced model's decoding) that the engine is still generating."""
CUT_AT = 0.3
"""The moves' rounds are cut at the latest this far into the time their reference round took."""
ROUND_TRIES = 3
"""Times a round whose four requests were never in flight together is sent (``_round_on``)."""
SESSION = "X-Session-ID"
PROMPT = "tell me a long story about the sea"
SHIFT = 0.05
"""How far step-1's ``lm_head`` moves: enough to change greedy tokens, not so far that the random model
makes runs of tokens without text (the router holds those from a streamed client until text comes)."""
VARIANTS = [(COMPLETIONS, False), (COMPLETIONS, True), (CHAT, False), (CHAT, True)]
GENERATED = "vllm:generation_tokens_total"


def _name(path: str, stream: bool) -> str:
    return ("chat" if path == CHAT else "completions") + ("-stream" if stream else "-whole")


@pytest.fixture(scope="module")
def fleet(vllm_python: str, paced_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Two real engines (one core each where there are two), a router with a record in front."""
    logdir = tmp_path_factory.mktemp("continuation-vllm")
    cpus = sorted(os.sched_getaffinity(0))
    engines = [
        dev_engine(
            vllm_python,
            paced_model_dir,
            logdir / f"engine{i}.log",
            cpus[i] if len(cpus) >= 2 else None,
            KEY,
            extra_args=["--dtype", "float32"],  # tests/support/tiny_model.PACED_DTYPE: why
        )
        for i in range(2)
    ]
    router: GenerationRouter | None = None
    try:
        try:
            took = start_all(engines)
        except EngineStartError as exc:
            pytest.fail(f"vLLM engine failed to start:\n{exc}", pytrace=False)
        print(f"\n[continuation vllm] 2 engines ready after {took:.0f} s")
        for e in engines:  # the router reads what the engine makes: a cut lands mid-generation
            assert generation_behind_serving(e), f"no engine core found below {e.pid}"
        config = RouterConfig(
            host="127.0.0.1",
            port=0,
            policy="consistent_hash",
            admin_token=TOKEN,
            backend_api_key=KEY,
            backend_timeout_s=300,
            record_dir=str(logdir / "record"),
            # One process: on a 2-core machine shared with the engines, worker processes starved each
            # other and the admin calls (a move_off, a refit's pause) came seconds after the answers ended.
            workers=1,
        )
        router = GenerationRouter(config, [e.url for e in engines])
        router.serve_in_background()
        client = FleetClient(router.base_url(), TOKEN)
        client.load_weights(paced_model_dir, "base")  # every engine stamped: the spans name versions
        sessions = _sessions(router, engines, logdir / "record")
        yield {
            "engines": engines,
            "router": router,
            "client": client,
            "logdir": logdir,
            "record": logdir / "record",
            "sessions": sessions,
        }
    finally:
        if router is not None:
            router.stop()
        for e in engines:
            e.stop()


class Round:
    """The four requests of one round, sent at once to the router, with their record ids; ``cut`` is set
    once both streamed ones have ``CUT_AFTER`` tokens (the whole ones, sent at the same moment to the
    same engine, have about as many: vLLM's Prometheus counters lag by seconds, so they cannot say)."""

    def __init__(self, url: str, tag: str, session: str) -> None:
        self.results: dict[str, Answer] = {}
        self.took = 0.0
        self.ids: dict[str, str] = {}
        self.threads: list[threading.Thread] = []
        self.cut = threading.Event()
        self._streams_there = 0
        self._lock = threading.Lock()
        for path, stream in VARIANTS:
            name = _name(path, stream)
            self.ids[name] = rid = f"{tag}-{name}-{uuid.uuid4().hex[:8]}"
            req = body(path, PROMPT, MAX_TOKENS, stream)
            mark = (CUT_AFTER, self._there) if stream else None
            head = {SESSION: session}
            self.threads.append(
                in_thread(self.results, name, url, path, req, rid, on_tokens=mark, headers=head)
            )

    def _there(self, _: Answer) -> None:
        with self._lock:
            self._streams_there += 1
            if self._streams_there == sum(stream for _, stream in VARIANTS):
                self.cut.set()

    def ended(self) -> bool:
        """Whether every request of the round has its answer (or its error)."""
        return not any(t.is_alive() for t in self.threads)

    def join(self, timeout_s: float = 600.0) -> dict[str, Answer]:
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a request did not end in time"
        return self.results


def _round_on(
    fleet: Any,
    engine: VllmEngine,
    tag: str,
    during: Callable[[], Any] | None = None,
    reference: Round | None = None,
) -> tuple[Round, Any]:
    """One round on ``engine`` (the four requests carry the session that the router's consistent-hash
    policy maps to it). With ``during``: ``during()`` runs (kill, drain, refit) at the first moment when
    the router has all four in flight and both streamed answers have their first ``CUT_AFTER`` tokens or
    ``CUT_AT`` of the ``reference`` round's time has gone by (the router holds a streamed answer's tokens
    while their text is pending, and this random model makes long runs of bytes that are not UTF-8: a
    client saw its 100th token when the engine had made 763).
    A round that never had that moment (on a loaded machine the router, sharing this process with the
    clients, took some heads seconds after the first, 5 to 7 s seen, and they ran one after the other)
    is let end and sent again, at most ``ROUND_TRIES`` times: ``during()`` runs once, mid-generation for
    all four, or the test fails. Returns the round, its answers in, and what ``during`` returned
    (``Round.took``: the seconds the round took)."""
    router: GenerationRouter = fleet["router"]
    for attempt in range(1, ROUND_TRIES + 1):
        batch = Round(router.base_url(), tag, fleet["sessions"][engine.url])
        t0 = time.monotonic()
        got = None
        if during is not None:
            by = t0 + (CUT_AT * reference.took if reference is not None else 300.0)
            _until(functools.partial(_cut_ready, batch, router, by, True), 300)
            if not _cut_ready(batch, router, by):
                batch.join()
                print(f"[continuation vllm] round {tag}: the four were not in flight together; again")
                continue
            got = during()
        t1 = time.monotonic()
        batch.join()
        batch.took = time.monotonic() - t0
        print(
            f"[continuation vllm] round {tag}: cut in {t1 - t0:.1f} s, then {time.monotonic() - t1:.1f} s"
            f" (try {attempt})"
        )
        return batch, got
    raise AssertionError(
        f"round {tag}: the four requests were never in flight together ({ROUND_TRIES} tries)"
    )


def _cut_ready(batch: Round, router: GenerationRouter, by: float, or_ended: bool = False) -> bool:
    """The router has all four in flight, and both streamed answers have their first ``CUT_AFTER`` tokens
    or it is past ``by`` (``or_ended``: or every request of the round has ended)."""
    if or_ended and batch.ended():
        return True
    there = batch.cut.is_set() or time.monotonic() >= by
    return there and sum(router.in_flight().values()) >= len(VARIANTS)


def _sessions(router: GenerationRouter, engines: list[VllmEngine], record: Path) -> dict[str, str]:
    """A session key per engine: the one the router's consistent-hash ring sends there (asked of the
    router itself: one-token requests, the record says which engine served each)."""
    found: dict[str, str] = {}
    for i in range(64):
        key = f"session-{i}"
        rid = f"which-engine-{i}-{uuid.uuid4().hex[:6]}"
        req = {**body(COMPLETIONS, "which engine", 1, False), "logprobs": None}
        answer = call(router.base_url(), COMPLETIONS, req, rid, headers={SESSION: key})
        assert answer.status == 200, answer.error_body
        line = record_line(record, rid)
        assert line is not None, rid
        found.setdefault(line["engine"], key)
        if len(found) == len(engines):
            return found
    raise AssertionError(f"no session key for every engine in 64 tries: {found}")


def _check_moved(
    fleet: Any, cut: Round, whole: Round, source: VllmEngine, reason: str
) -> dict[str, dict[str, Any]]:
    """Each cut answer is its reference and its record shows one move off ``source``; the moves by name."""
    problems: dict[str, list[str]] = {}
    moves: dict[str, dict[str, Any]] = {}
    for name, answer in cut.results.items():
        ref = whole.results[name]
        found = differences(answer, ref)
        line = record_line(fleet["record"], cut.ids[name])
        if line is None:
            found.append("no record line")
        else:
            got = line.get("moves") or []
            if len(got) != 1:
                attempts = [(a.get("engine"), a.get("outcome"), a.get("status")) for a in line["attempts"]]
                found.append(f"the record shows {len(got)} moves: {got}; attempts {attempts}")
            else:
                move = moves[name] = got[0]
                if move["from"] != source.url or move["to"] == source.url or move["reason"] != reason:
                    found.append(f"the record's move {move} (expected from {source.url}, {reason})")
                if not 0 < move["at_token"] < MAX_TOKENS:
                    found.append(f"moved at token {move['at_token']}")
                elif any("text differs" in f for f in found):
                    pending = pending_before(whole.results[name.replace("whole", "stream")], move["at_token"])
                    found.append(f"the cut followed an empty text piece (pending UTF-8 bytes): {pending}")
        if found:
            problems[name] = found
    for name, found in problems.items():
        print(f"  PROBLEM {name}: {found}")
    assert not problems, problems
    return moves


def _spans(answer: Answer) -> Any:
    return answer.spans if answer.stream else parse_header(answer.header_spans or "")


def _made_elsewhere(fleet: Any, engine: VllmEngine, before: float, moves: dict[str, dict[str, Any]]) -> float:
    """Tokens ``engine`` generated since ``before``: exactly those the moved requests had left (the
    counter lags: read until it says so, at most 30 s)."""
    left = sum(MAX_TOKENS - m["at_token"] for m in moves.values())
    _until(lambda: engine_counter(engine.url, KEY, GENERATED) - before >= left, 30)
    time.sleep(1.0)  # a counter that would go past it has time to
    made = engine_counter(engine.url, KEY, GENERATED) - before
    assert made == left, f"the engine that took the moves made {made} tokens, {left} were left"
    return made


def _print_moves(what: str, moves: dict[str, dict[str, Any]], made: float) -> None:
    at = ", ".join(f"{n} at token {m['at_token']}" for n, m in sorted(moves.items()))
    print(
        f"\n[continuation vllm] {what}: 4/4 answers identical to the uninterrupted ones; moved {at}; "
        f"the other engine generated {made:.0f} tokens, exactly those left"
    )


def _other(fleet: Any, engine: VllmEngine) -> VllmEngine:
    return next(e for e in fleet["engines"] if e is not engine)


def test_a_keep_mode_refit_gives_spans_that_match_its_pause(
    fleet: Any, vllm_python: str, paced_model_dir: Path
) -> None:
    """A keep-mode refit to other weights during long greedy generations: each answer's spans put the
    change at the token where the weights changed. Every answer (``x-rl-weight-versions`` and the same in
    the body for a whole one, the last chunk's for a streamed one): the tokens before the boundary are the
    old weights' greedy answer, the ones after it the new weights' greedy continuation of them; streamed,
    the boundary's token arrived after the refit resumed the engines (the step times it reports)."""
    client: FleetClient = fleet["client"]
    router: GenerationRouter = fleet["router"]
    e0 = fleet["engines"][0]
    step1 = _perturbed_copy(vllm_python, paced_model_dir, fleet["logdir"] / "paced-step-1", SHIFT)
    fleet["step1"] = step1
    whole, _ = _round_on(fleet, e0, "refit-reference")

    def refit() -> dict[str, Any]:
        # The trainer-driven form: it pauses first, then the load checks and reads the directory. (The
        # one-call load_weights checks the directory against the served model before it pauses, which on
        # these engines waited ~10 s, until the generations had ended.)
        with client.refit("step-1", source="directory") as txn:
            txn.load_weights(step1)
        assert txn.result is not None
        return txn.result

    cut, txn = _round_on(fleet, e0, "refit", refit, whole)
    assert txn["ok"], txn
    steps = {s["phase"]: s for s in txn["steps"]}
    assert {"pausing", "stamping", "resuming"} <= set(steps), txn["steps"]
    t, ends = txn["started_at"], {}
    for s in txn["steps"]:
        t += s["took_s"]
        ends[s["phase"]] = t
    paused_at = ends["pausing"]
    resumed_from = ends["resuming"] - steps["resuming"]["took_s"]
    problems: dict[str, Any] = {}
    for name, answer in cut.results.items():
        problems[name] = _span_problem(answer, whole.results[name], e0, paused_at, resumed_from)
    print(f"  refit {txn['started_at']:.3f} {txn['steps']}; problems {problems}")
    assert not any(problems.values()), (problems, txn["started_at"], txn["steps"])
    assert router.current_weight_version() == "step-1"
    window = resumed_from - paused_at
    print(
        f"\n[continuation vllm] keep-mode refit (paused {window:.2f} s before the resume): spans "
        + "; ".join(f"{n} {_spans(a)}" for n, a in sorted(cut.results.items()))
    )


def _span_problem(
    answer: Answer, ref: Answer, engine: VllmEngine, paused_at: float, resumed_from: float
) -> Any:
    if answer.status != 200 or len(answer.ids) != MAX_TOKENS:
        return f"status {answer.status}, {len(answer.ids)} tokens: {answer.error_body or answer.errors}"
    spans = _spans(answer)
    if not answer.stream and answer.spans != spans:
        return f"body {answer.spans} and header {answer.header_spans} differ"
    if [s[0] for s in spans] != ["base", "step-1"] or spans[0][1] != 0 or spans[-1][2] != MAX_TOKENS - 1:
        return f"spans {spans}"
    b = spans[1][1]
    if spans[0][2] != b - 1 or answer.ids[:b] != ref.ids[:b]:
        return f"spans {spans}: the first {b} tokens are not the old weights' answer"
    after = engine_completion(engine.url, KEY, (answer.prompt_ids or []) + answer.ids[:b], MAX_TOKENS - b)
    if after.ids != answer.ids[b:]:
        at = next(i for i, (x, y) in enumerate(zip(after.ids, answer.ids[b:], strict=False)) if x != y)
        return f"spans {spans}: the new weights' greedy continuation differs at token {b + at}"
    if answer.stream and answer.arrived[b] < resumed_from - 0.05:
        # A token of the new weights cannot reach the client before the refit resumed the engine. (When
        # the old ones arrived says little: this process's router and clients can be starved for seconds
        # on a loaded machine, 2.7 s seen; the boundary itself is checked by content above.)
        return (
            f"spans {spans}: token {b} arrived {answer.arrived[b] - resumed_from:+.3f} s from the resume "
            f"(the pause ended at {paused_at - resumed_from:+.3f} s)"
        )
    return None


def test_a_drained_engine_s_requests_go_on_elsewhere(fleet: Any) -> None:
    """An elastic drain asks the router to move the engine's requests (``GenerationRouter.move_off``, what
    the launcher's drain calls through the front) before the push that drops it: they go on at once on
    the other engine from the tokens they had; nothing waits for them to end."""
    router: GenerationRouter = fleet["router"]
    e0 = fleet["engines"][0]
    e1 = _other(fleet, e0)
    whole, _ = _round_on(fleet, e0, "drain-reference")
    before = engine_counter(e1.url, KEY, GENERATED)

    def drain() -> int:  # what the elastic drain asks; its push then drops the engine (not done here)
        return router.move_off([e0.url], "drained")

    try:
        cut, asked = _round_on(fleet, e0, "drain", drain, whole)
    finally:
        # move_off took the engine out of the fleet (what the drain's push then confirms); the next tests
        # need it back, as a restarted engine rejoins.
        router.set_serving_backends([e.url for e in fleet["engines"]])
        assert _until(lambda: set(router.serving_backends()) == {e.url for e in fleet["engines"]}, 120)
    assert asked == len(VARIANTS), asked  # the router's count of requests it asked to move
    moves = _check_moved(fleet, cut, whole, e0, "drained")
    made = _made_elsewhere(fleet, e1, before, moves)
    for name, answer in cut.results.items():
        assert _spans(answer) == [["step-1", 0, MAX_TOKENS - 1]], (name, _spans(answer))
    _print_moves("drained", moves, made)


def test_a_quarantined_engine_s_requests_go_on_elsewhere(fleet: Any) -> None:
    """A keep-mode refit whose load fails on the engine running the requests (its copy of the checkpoint
    is broken: vLLM's reload fails and leaves it without weights) quarantines it; its frozen requests
    move to the engine that verified the new version (the same weights under a new name) once the refit
    resumes the fleet, and their spans say so: the old version up to the move, the new one after. The
    trainer-driven form: it pauses first, then the load checks and reads the directories."""
    client: FleetClient = fleet["client"]
    e0 = fleet["engines"][0]
    e1 = _other(fleet, e0)
    step1: Path = fleet["step1"]
    bad = fleet["logdir"] / "paced-step-1-broken"
    shutil.copytree(step1, bad)
    next(bad.glob("*.safetensors")).unlink()  # what only vLLM's loader refuses (test_refit_vllm's recipe)
    with zipfile.ZipFile(bad / "pytorch_model.bin", "w") as archive:
        archive.writestr("archive/data.pkl", b"not a pickle")
    whole, _ = _round_on(fleet, e0, "quarantine-reference")
    before = engine_counter(e1.url, KEY, GENERATED)

    def refit() -> dict[str, Any]:
        with client.refit("step-2", source="directory") as txn:
            txn.load_weights(step1, per_engine={e0.url: bad})
        assert txn.result is not None
        return txn.result

    cut, txn = _round_on(fleet, e0, "quarantine", refit, whole)
    assert txn["verified"] == [e1.url] and list(txn["quarantined"]) == [e0.url], txn
    moves = _check_moved(fleet, cut, whole, e0, "quarantined")
    made = _made_elsewhere(fleet, e1, before, moves)
    for name, answer in cut.results.items():
        k = moves[name]["at_token"]
        assert _spans(answer) == [["step-1", 0, k - 1], ["step-2", k, MAX_TOKENS - 1]], (name, _spans(answer))
    _print_moves(f"quarantined ({txn['quarantined'][e0.url][:80]!r})", moves, made)
    # The fleet restores the engine from the directory it verified; the next test needs both engines.
    assert _until(lambda: client.stale_engines() == {}, 120), client.stale_engines()


def test_a_killed_engine_s_requests_go_on_elsewhere(fleet: Any) -> None:
    """SIGKILL to the engine (its whole process group: API server and engine core) in the middle of the
    four generations: each goes on on the other engine from the tokens the router had read. Last in
    the module: the engine stays dead."""
    router: GenerationRouter = fleet["router"]
    e0 = fleet["engines"][0]
    e1 = _other(fleet, e0)
    whole, _ = _round_on(fleet, e0, "kill-reference")
    before = engine_counter(e1.url, KEY, GENERATED)

    def kill() -> None:
        assert e0.pid is not None
        os.killpg(e0.pid, signal.SIGKILL)

    cut, _ = _round_on(fleet, e0, "kill", kill, whole)
    moves = _check_moved(fleet, cut, whole, e0, _broke_kind(fleet, cut))
    made = _made_elsewhere(fleet, e1, before, moves)
    for name, answer in cut.results.items():
        assert _spans(answer) == [["step-2", 0, MAX_TOKENS - 1]], (name, _spans(answer))
    assert e0.url not in router.serving_backends() or not e0.is_alive()
    _print_moves("SIGKILL", moves, made)


def _broke_kind(fleet: Any, cut: Round) -> str:
    """How the router saw the dead engine's streams break (the record's reason: a reset connection)."""
    line = record_line(fleet["record"], next(iter(cut.ids.values())))
    moves = (line or {}).get("moves") or [{}]
    reason = str(moves[0].get("reason"))
    assert reason in ("reset", "stream_broken", "stream_error", "timeout"), moves
    return reason
