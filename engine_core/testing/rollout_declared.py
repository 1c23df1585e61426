"""The rollout kit's checks of what a rollout declares beyond the base contract: stop strings
(``stop_strings``), each position's most likely tokens (``top_logprobs``), ``generate_async``
(``async_generation``), calls that join a running
batch (``continuous_batching``), adapters-only LoRA syncs
(``lora``), returned routes (``routing_replay``) and weights streamed to the rollout's own
processes over a group (``weight_sync_group``). A check of a capability the rollout does not
declare raises :class:`NotDeclared` (the test is skipped, saying so), except
``generate_async``, ``submit`` and ``join_weight_sync``, which must refuse when undeclared. Each raises :class:`PromiseBroken` as
the base checks in :mod:`engine_core.testing.rollout_kit` do, which lists them all in
``CHECKS``.
"""

from __future__ import annotations

import torch

from engine_core.capabilities import Capability
from engine_core.config import ModelConfig
from engine_core.errors import EngineCoreError, WeightSyncError
from engine_core.rollout import (
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    ROLLOUT_TOP_IDS,
    ROLLOUT_TOP_LOG_PROBS,
    TRUNCATED,
    SamplingParams,
    sent_buckets,
)
from engine_core.testing.rollout_subject import (
    PROMPTS,
    SEED,
    NotDeclared,
    Oracle,
    PromiseBroken,
    Subject,
    expect,
    expect_follows,
    generate,
    greedy_both,
    prompt_batch,
    responses,
)

__all__ = [
    "CannotRunHere",
    "check_async",
    "check_continuous",
    "check_lora",
    "check_routes",
    "check_stop_strings",
    "check_top_logprobs",
    "check_weight_sync_group",
]

TOP_ATOL = 2e-4  # float32 on both sides, as the base log-prob check allows


def _string_ending_inside(s: Subject, prompt: list[int], start: int) -> str:
    """Text of ``prompt``'s greedy continuation from token ``start`` on, two tokens' worth,
    cut one character short where the second token has more than one: a stop string whose
    last character lies inside a token."""
    cont = s.oracle.greedy(prompt, start + 2)
    text = s.oracle.decode(cont[start : start + 2])
    return text[:-1] if len(s.oracle.decode(cont[start + 1 : start + 2])) > 1 else text


def check_stop_strings(s: Subject) -> None:
    """Where ``stop_strings`` is declared: a sample ends after the first token at which its
    decoded text holds a stop string (that token kept, ``truncated`` False), also where the
    string ends inside a token; a sample that never holds one runs to its budget, truncated."""
    from engine_core.stop_strings import holds_stop_string, stop_string_end

    if Capability.STOP_STRINGS not in s.capabilities:
        raise NotDeclared("stop_strings")
    strings = [_string_ending_inside(s, PROMPTS[0], 2), _string_ending_inside(s, PROMPTS[2], 4)]
    params = SamplingParams(temperature=0, max_new_tokens=10, stop_strings=strings)
    out = generate(s, prompt_batch(), params)
    got, cut = responses(out), out[TRUNCATED].tolist()
    fix = (
        "after each token, decode the response so far with the model's tokenizer "
        "(skip_special_tokens=True; engine_core.stop_strings.load_stop_tokenizer) and end the "
        "sample there, not truncated, once the text holds one of params.stop_strings."
    )
    ended = 0
    for i, prompt in enumerate(PROMPTS):
        full = s.oracle.greedy(prompt, 10)
        end = stop_string_end(s.oracle.decode, full, strings)
        want = full if end is None else full[:end]
        ended += end is not None
        expect(
            got[i] == want,
            "stop strings",
            f"prompt {i} with stop_strings={strings!r}: got {got[i]} "
            f"({s.oracle.decode(got[i])!r}), want {want} ({s.oracle.decode(want)!r}).",
            fix,
        )
        expect(
            cut[i] == (end is None),
            "truncated",
            f"prompt {i}: the sample {'ran to max_new_tokens' if end is None else 'ended on a stop string'} "
            f"but truncated={cut[i]}.",
            "a sample that ends on a stop string is not truncated; truncated is True exactly "
            "where max_new_tokens ran out.",
        )
    assert ended >= 2, (strings, got)  # the kit's own choice of strings ends two prompts
    sampled = ["e", "q", "x"]
    out = generate(
        s,
        prompt_batch(),
        SamplingParams(temperature=1.5, max_new_tokens=10, n=4, seed=SEED, stop_strings=sampled),
    )
    for r, resp in enumerate(responses(out)):
        holds = [
            holds_stop_string(s.oracle.decode(resp[:k]), sampled)
            for k in (len(resp) - 1, len(resp))
        ]
        state = "truncated" if out[TRUNCATED][r] else "not truncated"
        expect(
            not holds[0] and holds[1] != bool(out[TRUNCATED][r]),
            "stop strings",
            f"sample {r} ({state}) is {s.oracle.decode(resp)!r} with stop_strings={sampled!r}.",
            fix,
        )


def check_top_logprobs(s: Subject) -> None:
    """Where ``top_logprobs`` is declared: at each response position, the ``k`` tokens returned
    are the oracle's ``k`` most likely at the sampling temperature, most likely first, each
    with its log-prob there; the sampled token, where it is among them, with the log-prob
    ``rollout_log_probs`` gives it; 0 at padding."""
    from engine_core.testing.rollout_subject import prompt_of

    if Capability.TOP_LOGPROBS not in s.capabilities:
        raise NotDeclared("top_logprobs")
    k, temperature = 3, 0.7
    p = prompt_batch()
    params = SamplingParams(temperature=temperature, max_new_tokens=5, n=2, seed=SEED)
    out = generate(s, p, params.model_copy(update={"top_logprobs": k}))
    fix = (
        "with params.top_logprobs = k, return rollout_top_ids and rollout_top_log_probs "
        "[B*n, R, k]: at each response position the k largest of log_softmax(logits / "
        "temperature) over the whole vocabulary, most likely first, 0 at padding."
    )
    for key in (ROLLOUT_TOP_IDS, ROLLOUT_TOP_LOG_PROBS):
        shape = tuple(out[key].shape) if key in out.keys() else None
        want = (*out[RESPONSE_IDS].shape, k)
        expect(shape == want, "top log-probs", f"{key} has shape {shape}, want {want}.", fix)
    mask = out[RESPONSE_MASK].bool()
    for r, resp in enumerate(responses(out)):
        every = torch.log_softmax(
            s.oracle.next_log_probs(prompt_of(p, r // 2), resp) / temperature, -1
        )
        ids, values = out[ROLLOUT_TOP_IDS][r], out[ROLLOUT_TOP_LOG_PROBS][r].float()
        for pos, token in enumerate(resp):
            best = every[pos].topk(k).values
            theirs = every[pos][ids[pos]]  # the oracle's log-probs of the ids returned
            err = max(
                float((values[pos] - best).abs().max()), float((theirs - values[pos]).abs().max())
            )
            expect(
                err <= TOP_ATOL,
                "top log-probs",
                f"sample {r}, position {pos}: returned ids {ids[pos].tolist()} with log-probs "
                f"{[round(x, 4) for x in values[pos].tolist()]}; the oracle's top {k} are "
                f"{[round(x, 4) for x in best.tolist()]} (off by up to {err:.3g}).",
                fix,
            )
            if token in ids[pos].tolist():
                at = ids[pos].tolist().index(token)
                sampled = float(out[ROLLOUT_LOG_PROBS][r][pos])
                expect(
                    abs(float(values[pos][at]) - sampled) <= TOP_ATOL,
                    "top log-probs",
                    f"sample {r}, position {pos}: the sampled token {token} has log-prob "
                    f"{sampled:.4g} in rollout_log_probs but {float(values[pos][at]):.4g} among "
                    f"the top ones.",
                    "take both from one distribution: log_softmax(logits / temperature).",
                )
        padded = ~mask[r]
        expect(
            not out[ROLLOUT_TOP_IDS][r][padded].any()
            and not out[ROLLOUT_TOP_LOG_PROBS][r][padded].any(),
            "top log-probs",
            f"sample {r}: non-zero top ids or log-probs at padding.",
            fix,
        )


def check_async(s: Subject) -> None:
    """Where ``async_generation`` is declared, ``generate_async(...).result()`` is ``generate``."""
    p = prompt_batch()
    params = SamplingParams(temperature=1.0, max_new_tokens=5, n=2, seed=SEED)
    if Capability.ASYNC_GENERATION not in s.capabilities:
        try:
            s.rollout.generate_async(p, params)
        except EngineCoreError:
            return
        raise PromiseBroken(
            "async generation",
            "generate_async() ran without async_generation declared.",
            "declare async_generation, or leave BaseRollout.generate_async as it is.",
        )
    pending = s.rollout.generate_async(p, params)
    got = responses(pending.result())
    expect(
        got == responses(generate(s, p, params)),
        "async generation",
        "generate_async(...).result() differs from generate(...) for the same seeded call.",
        "return a pending result of exactly what generate returns.",
    )


def check_continuous(s: Subject) -> None:
    """Where ``continuous_batching`` is declared, two seeded calls, the second submitted after
    the first has taken an engine step, are each collected as ``generate`` returns it."""
    p = prompt_batch()
    first_params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=SEED)
    second_params = SamplingParams(temperature=1.0, max_new_tokens=3, n=1, seed=SEED + 1)
    if Capability.CONTINUOUS_BATCHING not in s.capabilities:
        try:
            s.rollout.submit(p, first_params)
        except EngineCoreError:
            return
        raise PromiseBroken(
            "continuous batching",
            "submit() ran without continuous_batching declared.",
            "declare continuous_batching, or leave BaseRollout.submit as it is.",
        )
    first = s.rollout.submit(p, first_params)
    finished = s.rollout.advance()
    second = s.rollout.submit(p, second_params)
    for _ in range(1000):  # far more steps than the two calls' tokens
        if len(finished) >= 2:
            break
        finished += s.rollout.advance()
    expect(
        sorted(finished) == sorted([first, second]),
        "continuous batching",
        f"advance() reported tickets {finished}, submitted {[first, second]}.",
        "report each submitted call's ticket once, in the step that finishes its last sample.",
    )
    collected = {ticket: responses(s.rollout.collect(ticket)) for ticket in (first, second)}
    for ticket, params in ((first, first_params), (second, second_params)):
        got = collected[ticket]
        expect(
            got == responses(generate(s, p, params)),
            "continuous batching",
            f"call {ticket} collected {got}, generate returns other samples for it.",
            "draw a submitted call's samples from its own seeds, as generate does.",
        )


def check_lora(s: Subject) -> None:
    """With ``lora`` declared, a rollout built with ``model.lora`` takes the peft tensors once,
    then the adapters alone, and generates as the peft model with the adapters last sent."""
    from engine_core.config import LoraConfig
    from engine_core.models import build_model, is_adapter_name

    if Capability.LORA not in s.capabilities:
        raise NotDeclared("lora")
    assert s.build is not None
    model = ModelConfig(path=s.folder, lora=LoraConfig(rank=4, alpha=8.0))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        oracle = Oracle(s.folder, build_model(model))
    g = torch.Generator().manual_seed(SEED + 2)

    def adapters() -> dict[str, torch.Tensor]:
        state = oracle.state()
        return {
            n: 0.3 * torch.randn(t.shape, generator=g) if is_adapter_name(n) else t
            for n, t in state.items()
        }

    rollout = s.build(model)
    fix = (
        "serve model.lora's adapters unmerged: expected_weights() names the peft tensors, the "
        "first sync loads them all, a sync of the adapters alone replaces the adapters."
    )
    try:
        expected = rollout.expected_weights()
        shapes = {n: tuple(t.shape) for n, t in oracle.state().items()}
        expect(
            expected == shapes,
            "lora",
            f"expected_weights() is not the peft model's names and shapes ({sorted(set(expected) ^ set(shapes))[:4]}).",
            fix,
        )
        first = adapters()
        for label, state, stream in (
            ("the first sync (base and adapters)", first, first),
            (
                "a sync of the adapters alone",
                second := adapters(),
                {n: t for n, t in second.items() if is_adapter_name(n)},
            ),
        ):
            try:
                rollout.load_weights(sent_buckets(sorted(stream.items()), 16 << 10))
            except WeightSyncError as e:
                raise PromiseBroken("lora", f"{label} was refused: {e}", fix) from e
            oracle.load(state)
            got, want = greedy_both(rollout, oracle, 6)
            expect(
                got == want,
                "lora",
                f"after {label}, greedy gives {got}; the peft model with the adapters sent gives {want}.",
                fix,
            )
    finally:
        rollout.shutdown()


class CannotRunHere(Exception):
    """The rollout declares what the check is about, but refused to start it on this host,
    saying why (e.g. vLLM records routes only where Triton runs)."""


def check_routes(s: Subject) -> None:
    """Where ``routing_replay`` is declared: started with ``return_routes`` on a mixture of
    experts, the rollout returns ``routed_experts`` ``[B*n, P+R, layers, top_k]`` whose every
    prompt and response token (the last, fed to no forward, aside) holds the experts the
    oracle's routers choose for it in one forward over the whole sequence."""
    import tempfile

    from engine_core.errors import CapabilityError
    from engine_core.moe import RouteRecorder
    from engine_core.rollout import ROUTED_EXPERTS
    from engine_core.testing.rollout_subject import kit_moe_config, save_kit_model

    if Capability.ROUTING_REPLAY not in s.capabilities:
        raise NotDeclared("routing_replay")
    assert s.build is not None
    config = kit_moe_config()
    fix = (
        "record each forward's router choice (engine_core.moe.RouteRecorder on a transformers "
        "model) and place the prompt's and each fed-back token's experts at their positions "
        "(engine_core.rollout.place_routes)."
    )
    with tempfile.TemporaryDirectory(prefix="engine-core-rollout-kit-moe-") as folder:
        save_kit_model(folder, config)
        try:
            rollout = s.build(ModelConfig(path=folder), return_routes=True)
        except CapabilityError as e:
            raise CannotRunHere(str(e)) from e
        try:
            params = SamplingParams(
                temperature=1.0, max_new_tokens=6, n=2, seed=SEED, return_routes=True
            )
            out = rollout.generate(prompt_batch(), params)
        finally:
            rollout.shutdown()
        model = Oracle(folder).model
    expect(
        ROUTED_EXPERTS in out.keys(),
        "routes",
        f"return_routes=True but the result has no {ROUTED_EXPERTS}.",
        fix,
    )
    routes = out[ROUTED_EXPERTS]
    width, rows = out[PROMPT_IDS].shape[1], out.batch_size[0]
    layers, top_k = config["num_hidden_layers"], config["num_experts_per_tok"]
    shape = (rows, width + out[RESPONSE_IDS].shape[1], layers, top_k)
    expect(
        tuple(routes.shape) == shape,
        "routes",
        f"{ROUTED_EXPERTS} has shape {tuple(routes.shape)}, want {shape} "
        f"([B*n, P+R, layers, top_k]).",
        fix,
    )
    for k in range(rows):
        p, r = out[PROMPT_MASK][k].bool(), out[RESPONSE_MASK][k].bool()
        ids = torch.cat([out[PROMPT_IDS][k][p], out[RESPONSE_IDS][k][r]])
        with torch.no_grad(), RouteRecorder(model) as rec:
            model(ids[None])
        want = rec.routes().permute(1, 0, 2).sort(-1).values[:-1]  # [tokens, layers, top_k]
        got = torch.cat([routes[k, :width][p], routes[k, width:][r]]).sort(-1).values[:-1]
        wrong = (got != want).any(-1).any(-1).nonzero().flatten().tolist()
        if wrong:
            t = wrong[0]
            raise PromiseBroken(
                "routes",
                f"sample {k}: the experts returned for tokens {wrong} (of {len(ids)}) are not "
                f"the routers' (token {t}: got {got[t].tolist()}, want {want[t].tolist()}).",
                fix,
            )


def check_weight_sync_group(s: Subject) -> None:
    """Where ``weight_sync_group`` is declared: the rollout's processes (one per name in
    ``receiver_names``) join a :class:`~engine_core.weight_sync.WeightSyncGroup` whose rank 0
    is the kit, take a stream of the changed weights in 16 KiB buckets, verified (greedy then
    equals the oracle on them), refuse a partial stream (the kit's ``send_weights`` raises
    naming a receiver) and take the next good one; without it, ``join_weight_sync`` refuses."""
    from engine_core.executors.base import free_port
    from engine_core.weight_sync import WeightSyncGroup, send_weights

    fix = (
        "join the group as ranks first_rank.. (one per process that holds weights) and load "
        "each received stream through load_weights (engine_core.weight_sync.receive_weights)."
    )
    host, port = "127.0.0.1", free_port()
    names = list(s.rollout.receiver_names)
    world = len(names) + 1  # the kit as rank 0, then one rank per receiver
    if Capability.WEIGHT_SYNC_GROUP not in s.capabilities:
        try:
            s.rollout.join_weight_sync(host, port, 1, world)
        except EngineCoreError:
            return
        raise PromiseBroken(
            "weight sync group",
            "join_weight_sync() ran without weight_sync_group declared.",
            "declare weight_sync_group, or leave BaseRollout.join_weight_sync as it is.",
        )
    joining = s.rollout.join_weight_sync(host, port, 1, world)
    group = WeightSyncGroup(host=host, port=port, rank=0, world_size=world)
    try:
        joining.result()

        def stream(state: dict[str, torch.Tensor]) -> Exception | None:
            """The sender's error (None: every receiver verified the stream); a receiver's
            own failure is raised only where the sender saw none."""
            receiving = s.rollout.receive_weights()
            sent: Exception | None = None
            try:
                send_weights(
                    group, sorted(state.items()), bucket_bytes=16 << 10, receiver_names=names
                )
            except WeightSyncError as e:
                sent = e
            try:
                receiving.result()
            except EngineCoreError:
                if sent is None:
                    raise
            return sent

        for state, label in ((s.changed, "a stream"), (s.initial, "a second stream")):
            refused = stream(state)
            expect(
                refused is None,
                "weight sync group",
                f"{label} over the group was refused: {refused}",
                fix,
            )
            expect_follows(s, state, "weight sync group", f"{label} over the group", fix)
        refused = stream(dict(sorted(s.changed.items())[:-1]))  # a parameter left out
        if refused is None:
            raise PromiseBroken("weight sync group", "a partial stream was accepted.", fix)
        expect(
            any(n in str(refused) for n in names),
            "weight sync group",
            f"a partial stream was refused without naming its receiver: {refused}",
            "report each receiver's failure back to the sender (receive_weights does).",
        )
        # the next good stream goes through, and the kit's weights are back
        expect(
            stream(s.initial) is None,
            "weight sync group",
            "after a refused stream, a good one was refused.",
            fix,
        )
        got, want = greedy_both(s.rollout, s.oracle, 6)
        expect(
            got == want,
            "weight sync group",
            "after a refused stream, a good one was not applied.",
            fix,
        )
    finally:
        s.rollout.leave_weight_sync()
        group.close()
