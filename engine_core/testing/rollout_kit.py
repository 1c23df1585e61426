"""The rollout conformance kit's checks: every promise of :class:`engine_core.rollout.BaseRollout`
against an oracle.

The oracle is a plain transformers forward on the same weights, one sequence at a time: its
greedy continuation (argmax at every step, ending at a stop id), and its log-probs of any
sampled sequence at a temperature. A rollout under test is started from a tiny Qwen2 saved in a
folder (:func:`start_rollout`: ``NAME``, a registered rollout in this process;
``process:NAME``, two replicas of it in processes of their own; ``interpreter:NAME``, two
replicas started as an interpreter of their own is, their weights relayed over their pipes)
and driven through its public
API only. Each check raises :class:`PromiseBroken`, whose message names the promise, what was
seen and how to fix it; :mod:`engine_core.testing.rollout_contract` holds the pytest tests that
run them (``pytest --engine-core-rollout=NAME``). The rollout under test, the oracle and the
prompts are in :mod:`engine_core.testing.rollout_subject`.

Promises checked (``docs/conformance.md`` pairs each with its clause): the response layout and
masks; greedy equals the oracle's; log-probs at the requested temperature; top-k and top-p keep
the sampled tokens inside the oracle's top-k and nucleus; seeds reproduce a prompt's samples
whatever the batch around it; the ``n`` samples of a prompt in order; stop ids end a sample
(the stop id kept as its last token) and ``truncated`` says which samples ran out; a weight
update in buckets applied and verified, a partial, misshapen or corrupted one refused; weights
kept through ``release`` / ``resume``; bad input refused; ``generate_async`` and adapters-only
LoRA syncs where declared; stop strings end a sample where their definition says
(:mod:`engine_core.stop_strings`) where declared; returned routes against the oracle's routers
where ``routing_replay`` is declared; weights streamed over a group into the rollout's own
processes where ``weight_sync_group`` is. The checks of declared capabilities (stop strings,
async generation, LoRA, routes, the weight-sync group) are in
:mod:`engine_core.testing.rollout_declared`; ``CHECKS`` lists every check. Not checked yet: vision inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

from engine_core.capabilities import Capability
from engine_core.errors import EngineCoreError, WeightSyncError
from engine_core.rollout import (
    PROMPT_IDS,
    PROMPT_MASK,
    PROMPT_SEED,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    TRUNCATED,
    SamplingParams,
    prompt_seeds,
    sent_buckets,
    tensor_checksum,
)
from engine_core.testing.rollout_declared import (
    CannotRunHere,
    check_async,
    check_continuous,
    check_lora,
    check_routes,
    check_stop_strings,
    check_top_logprobs,
    check_weight_sync_group,
)
from engine_core.testing.rollout_subject import (
    INTERPRETER_PREFIX,
    PROCESS_PREFIX,
    PROMPTS,
    SEED,
    VOCAB,
    NotDeclared,
    PromiseBroken,
    Subject,
    expect,
    expect_follows,
    generate,
    greedy_both,
    prompt_batch,
    prompt_of,
    responses,
    runs_on_cpu,
    start_rollout,
    started,
)

__all__ = [
    "PromiseBroken",
    "NotDeclared",
    "Subject",
    "start_rollout",
    "started",
    "runs_on_cpu",
    "CHECKS",
    "CannotRunHere",
    "PROCESS_PREFIX",
    "INTERPRETER_PREFIX",
]

LOG_PROB_ATOL = 2e-4  # float32 on both sides; a kernel's order of sums differs, nothing else


# -- the checks -------------------------------------------------------------------------------


def check_layout(s: Subject) -> None:
    """The result's fields, shapes, dtypes, right padding and masks."""
    p = prompt_batch()
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=SEED)
    out = generate(s, p, params)
    promise, fix = "layout", "see BaseRollout.generate's docstring for each field."
    b = len(PROMPTS) * 2
    for key in (PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOG_PROBS, TRUNCATED):
        expect(key in out.keys(), promise, f"the result has no {key!r}.", fix)
    expect(out.batch_size[0] == b, promise, f"{out.batch_size[0]} rows for {b} samples.", fix)
    want = p[PROMPT_IDS].repeat_interleave(2, 0)
    expect(
        torch.equal(out[PROMPT_IDS], want)
        and torch.equal(out[PROMPT_MASK], p[PROMPT_MASK].repeat_interleave(2, 0)),
        promise,
        "prompt_ids / prompt_mask are not the prompts, each repeated n times in place.",
        fix,
    )
    ids, mask, lp = out[RESPONSE_IDS], out[RESPONSE_MASK], out[ROLLOUT_LOG_PROBS]
    expect(
        ids.dtype == torch.long and ids.ndim == 2,
        promise,
        f"response_ids is {ids.dtype} {tuple(ids.shape)}.",
        fix,
    )
    expect(
        mask.shape == ids.shape and lp.shape == ids.shape,
        promise,
        "response_mask / rollout_log_probs are not response_ids' shape.",
        fix,
    )
    expect(lp.is_floating_point(), promise, f"rollout_log_probs is {lp.dtype}.", fix)
    expect(
        ids.shape[1] <= params.max_new_tokens,
        promise,
        f"{ids.shape[1]} response columns for max_new_tokens={params.max_new_tokens}.",
        fix,
    )
    expect(
        ((mask == 0) | (mask == 1)).all(),
        promise,
        "response_mask holds values other than 0/1.",
        fix,
    )
    expect(
        (mask[:, 1:] <= mask[:, :-1]).all(),
        promise,
        "response_mask is not right-padded (a 1 after a 0).",
        fix,
    )
    expect((mask.sum(-1) >= 1).all(), promise, "a sample has no token.", fix)
    pad = s.rollout.pad_token_id
    expect(
        (ids[mask == 0] == pad).all(),
        promise,
        f"response_ids is not padded with pad_token_id={pad}.",
        fix,
    )
    expect((lp[mask == 0] == 0).all(), promise, "rollout_log_probs is not 0 at padding.", fix)
    expect((lp[mask == 1] <= 1e-6).all(), promise, "a log-prob is positive.", fix)
    t = out[TRUNCATED]
    expect(
        t.dtype == torch.bool and tuple(t.shape) == (b,),
        promise,
        f"truncated is {t.dtype} {tuple(t.shape)}, not bool [{b}].",
        fix,
    )
    expect(
        ((ids >= 0) & (ids < VOCAB))[mask == 1].all(),
        promise,
        "a response token is outside the vocabulary.",
        fix,
    )


def check_greedy(s: Subject) -> None:
    """temperature=0: every prompt's continuation is the oracle's argmax at every step."""
    p = prompt_batch(pad=2)
    out = generate(s, p, SamplingParams(temperature=0, max_new_tokens=8))
    got = responses(out)
    for i, prompt in enumerate(PROMPTS):
        want = s.oracle.greedy(prompt, 8)
        expect(
            got[i] == want,
            "greedy",
            f"prompt {i} {prompt}: generated {got[i]}, a plain forward's argmax gives {want}.",
            "at temperature 0 take the argmax of the model's logits at every step, from the "
            "prompt's real tokens only (left padding masked, positions counted from the first "
            "real token).",
        )
    expect(
        out[TRUNCATED].all(),
        "truncated",
        f"greedy samples that ran to max_new_tokens with no stop id have truncated={out[TRUNCATED].tolist()}.",
        "set truncated True where a sample reached max_new_tokens without a stop id.",
    )
    check_log_probs_of(s, p, out, 1.0, "greedy log-probs")


def check_log_probs_of(
    s: Subject, p: TensorDict, out: TensorDict, temperature: float, promise: str
) -> None:
    got = responses(out)
    n = out.batch_size[0] // p.batch_size[0]
    mask = out[RESPONSE_MASK].bool()
    for k, resp in enumerate(got):
        want = s.oracle.log_probs(prompt_of(p, k // n), resp, temperature)
        have = out[ROLLOUT_LOG_PROBS][k][mask[k]].float()
        err = float((have - want).abs().max())
        expect(
            err <= LOG_PROB_ATOL,
            promise,
            f"sample {k} (prompt {k // n}): rollout_log_probs differ from a plain forward's at "
            f"temperature {temperature} by up to {err:.3g} (allowed {LOG_PROB_ATOL}); got "
            f"{[round(x, 4) for x in have.tolist()]}, want {[round(x, 4) for x in want.tolist()]}.",
            "report log_softmax(logits / temperature) of each sampled token over the whole "
            "vocabulary (temperature 1 when greedy; top-k / top-p change what can be sampled, "
            "not these log-probs).",
        )


def check_log_probs(s: Subject) -> None:
    """Sampled tokens' log-probs equal the oracle's at the requested temperature."""
    p = prompt_batch()
    for temperature in (0.6, 1.4):
        params = SamplingParams(temperature=temperature, max_new_tokens=6, n=2, seed=SEED)
        check_log_probs_of(s, p, generate(s, p, params), temperature, "log-probs")


def check_top_k_top_p(s: Subject) -> None:
    """Sampled tokens lie in the oracle's top-k / top-p nucleus at every position."""
    p = prompt_batch()
    for kwargs in ({"top_k": 2}, {"top_p": 0.3}):
        params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=SEED, **kwargs)
        try:
            out = generate(s, p, params)
        except (EngineCoreError, ValueError, NotImplementedError):
            continue  # refused: a rollout may refuse what it cannot honour
        for k, resp in enumerate(responses(out)):
            logp = s.oracle.next_log_probs(prompt_of(p, k // 2), resp)
            for pos, token in enumerate(resp):
                probs = logp[pos].exp()
                if "top_k" in kwargs:
                    ok = int((probs > probs[token] + 1e-6).sum()) < kwargs["top_k"]
                else:
                    ok = float(probs[probs > probs[token] + 1e-6].sum()) < kwargs["top_p"]
                expect(
                    ok,
                    "top-k / top-p",
                    f"{kwargs}: sample {k}, token {pos} ({token}) is outside the oracle's "
                    f"{'top-k' if 'top_k' in kwargs else 'nucleus'} (its probability "
                    f"{float(probs[token]):.3g}).",
                    "sample only among the top_k most likely tokens / the smallest set whose "
                    "probability reaches top_p, or refuse the setting in check_params.",
                )


def check_seeds(s: Subject) -> None:
    """A prompt's seeded samples are the same however the prompts around it are batched."""
    p = prompt_batch()
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=3, seed=SEED)
    whole = responses(generate(s, p, params))
    fix = (
        "draw sample j of prompt i from a stream seeded with derive_seed(prompt_seeds(prompts, "
        "params)[i], j) alone (engine_core.rollout.sample_seeds), never from one generator "
        "shared by the batch."
    )
    again = responses(generate(s, p, params))
    expect(again == whole, "seeds", "the same seeded call twice gave different samples.", fix)
    seeds = prompt_seeds(p, params)
    assert seeds is not None
    one = prompt_batch([list(PROMPTS[2])], pad=3)
    one[PROMPT_SEED] = torch.tensor([seeds[2]], dtype=torch.int64)
    alone = responses(generate(s, one, params.model_copy(update={"seed": None})))
    expect(
        alone == whole[6:9],
        "seeds",
        f"prompt 2 alone (its prompt_seed kept, padded wider) gave {alone}, in its batch {whole[6:9]}.",
        fix,
    )
    order = [3, 1, 0, 2]
    shuffled = prompt_batch([list(PROMPTS[i]) for i in order])
    shuffled[PROMPT_SEED] = torch.tensor([seeds[i] for i in order], dtype=torch.int64)
    got = responses(generate(s, shuffled, params.model_copy(update={"seed": None})))
    want = [r for i in order for r in whole[3 * i : 3 * i + 3]]
    expect(
        got == want,
        "seeds",
        "the prompts reordered (their prompt_seed kept) gave other samples.",
        fix,
    )
    other = responses(generate(s, p, params.model_copy(update={"seed": SEED + 7})))
    expect(
        other != whole,
        "seeds",
        "another seed gave the very same samples: the seed is not used.",
        fix,
    )
    expect(
        len({tuple(r) for r in whole}) > len(PROMPTS),
        "seeds",
        f"the n samples of a prompt are copies of each other: {whole}.",
        fix,
    )


def check_sample_order(s: Subject) -> None:
    """The ``n`` samples of prompt ``i`` are rows ``i*n .. i*n+n-1``, sample ``j`` at ``i*n+j``."""
    p = prompt_batch()
    three = responses(
        generate(s, p, SamplingParams(temperature=1.0, max_new_tokens=5, n=3, seed=SEED))
    )
    one = responses(
        generate(s, p, SamplingParams(temperature=1.0, max_new_tokens=5, n=1, seed=SEED))
    )
    for i in range(len(PROMPTS)):
        expect(
            three[3 * i] == one[i],
            "sample order",
            f"with n=3, row {3 * i} (prompt {i}'s sample 0) is {three[3 * i]}; with n=1 prompt "
            f"{i}'s sample 0 is {one[i]}.",
            "return prompt i's samples at rows i*n..i*n+n-1, sample j (seeded with "
            "derive_seed(prompt seed, j)) at row i*n+j.",
        )


def _stop_id(s: Subject, prompt: list[int]) -> tuple[int, int]:
    """A token of ``prompt``'s greedy continuation that appears there first at position k >= 1."""
    cont = s.oracle.greedy(prompt, 8)
    for k in range(1, len(cont)):
        if cont[k] not in cont[:k]:
            return cont[k], k
    raise AssertionError(f"the kit's model repeats one token greedily: {cont}")


def check_stop(s: Subject) -> None:
    """A stop id ends a sample as its last token, ``truncated`` False; a sample that runs out
    of tokens has ``truncated`` True."""
    stop, k = _stop_id(s, PROMPTS[0])
    p = prompt_batch()
    out = generate(s, p, SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=[stop]))
    got, cut = responses(out), out[TRUNCATED].tolist()
    fix_stop = "end a sample at the first stop id it samples, keeping that id as its last token (response_mask 1 there)."
    for i, prompt in enumerate(PROMPTS):
        want = s.oracle.greedy(prompt, 8, (stop,))
        expect(
            got[i] == want,
            "stop ids",
            f"prompt {i} with stop_token_ids=[{stop}]: got {got[i]}, want {want}.",
            fix_stop,
        )
        stopped = bool(want) and want[-1] == stop
        expect(
            cut[i] == (not stopped),
            "truncated",
            f"prompt {i}: the sample {'ended on its stop id' if stopped else 'ran to max_new_tokens'} but truncated={cut[i]}.",
            "truncated is True exactly where a sample reached max_new_tokens without a stop id.",
        )
    assert len(got[0]) == k + 1  # the kit's own choice of stop id is right
    params = SamplingParams(
        temperature=1.5, max_new_tokens=10, n=4, seed=SEED, stop_token_ids=[stop, 7]
    )
    out = generate(s, p, params)
    for r, resp in enumerate(responses(out)):
        stops = [j for j, t in enumerate(resp) if t in (stop, 7)]
        if out[TRUNCATED][r]:
            expect(
                not stops and len(resp) == 10,
                "truncated",
                f"sample {r} is truncated but is {resp}.",
                "truncated only where max_new_tokens ran out with no stop id.",
            )
        else:
            expect(
                stops == [len(resp) - 1],
                "stop ids",
                f"sample {r} is not truncated but is {resp} (stop ids {stop}, 7).",
                fix_stop,
            )


def _sync(s: Subject, state: dict[str, torch.Tensor]) -> list[Any]:
    named = sorted(state.items())
    return list(s.rollout.load_weights(sent_buckets(named, 16 << 10)))


def check_weights(s: Subject) -> None:
    """A weight update in buckets is applied and verified; partial, misshapen and corrupted
    updates are refused; the next good update goes through."""
    fix = "load every bucket through BaseRollout.load_weights (checked_buckets, confirm_bucket), returning the checksum of what the model holds."
    expected = s.rollout.expected_weights()
    shapes = {n: tuple(t.shape) for n, t in s.initial.items()}
    expect(
        expected == shapes,
        "expected weights",
        f"expected_weights() differs from the model's HF names and shapes: {sorted(set(expected) ^ set(shapes))[:5] or 'shapes differ'}.",
        "return the HF name and shape of every tensor the model takes.",
    )
    try:
        for state, label in ((s.changed, "an update"), (s.initial, "a second update")):
            done = _sync(s, state)
            names = {n for b in done for n in b.names}
            expect(
                len(done) > 1 and names == set(shapes),
                "weight update",
                f"{label} reported {len(done)} buckets covering {len(names)} of {len(shapes)} parameters.",
                fix,
            )
            expect_follows(
                s, state, "weight update", label, "apply every bucket to the model that generates."
            )
        named = sorted(s.initial.items())
        broken: dict[str, list[tuple[str, torch.Tensor]]] = {
            "partial": named[:-1],
            "misshapen": [(n, t[:1] if i == 0 else t) for i, (n, t) in enumerate(named)],
        }
        for what, stream in broken.items():
            try:
                s.rollout.load_weights(sent_buckets(stream, 16 << 10))
            except WeightSyncError:
                continue
            raise PromiseBroken("weight update", f"a {what} update was accepted.", fix)
        buckets = list(sent_buckets(named, 16 << 10))
        bucket, sent = buckets[1]
        flipped = [(n, t.clone()) for n, t in bucket]
        flipped[0][1].view(-1)[0] += 1.0  # changed after its checksum was taken
        try:
            s.rollout.load_weights([buckets[0], (flipped, sent), *buckets[2:]])
        except WeightSyncError:
            pass
        else:
            raise PromiseBroken(
                "weight update", "a bucket changed after the sender hashed it was accepted.", fix
            )
        _sync(s, s.initial)  # the next good update still goes through
        got, want = greedy_both(s.rollout, s.oracle, 6)
        expect(
            got == want,
            "weight update",
            "after refused updates, a good one was not applied.",
            fix,
        )
    finally:
        s.oracle.load(s.initial)


def check_release_resume(s: Subject) -> None:
    """``release`` then ``resume`` keep the weights last loaded."""
    _sync(s, s.changed)
    try:
        s.oracle.load(s.changed)
        s.rollout.release()
        s.rollout.resume()
        got, want = greedy_both(s.rollout, s.oracle, 6)
        expect(
            got == want,
            "release / resume",
            f"after release() and resume(), greedy gives {got}; the loaded weights give {want}.",
            "resume() brings back the weights release() freed (or both are no-ops).",
        )
    finally:
        _sync(s, s.initial)
        s.oracle.load(s.initial)


def check_refusals(s: Subject) -> None:
    """Bad input is refused before anything is generated, and the rollout still works after."""
    good = SamplingParams(temperature=0, max_new_tokens=4)
    empty = prompt_batch([[9, 21], [40, 17]])
    empty[PROMPT_MASK][1] = 0
    outside = prompt_batch([[9, 21], [40, VOCAB]])
    negative = prompt_batch([[9, -3]])
    cases: list[tuple[str, TensorDict, SamplingParams]] = [
        ("an empty prompt (a row of prompt_mask all 0)", empty, good),
        (f"a token id out of the vocabulary ({VOCAB})", outside, good),
        ("a negative token id", negative, good),
        (
            "max_new_tokens=0 (params built without validation)",
            prompt_batch(),
            SamplingParams.model_construct(**{**good.model_dump(), "max_new_tokens": 0}),
        ),
        (
            "temperature=-1 (params built without validation)",
            prompt_batch(),
            SamplingParams.model_construct(**{**good.model_dump(), "temperature": -1.0}),
        ),
        (
            "no prompt_mask",
            TensorDict({PROMPT_IDS: prompt_batch()[PROMPT_IDS]}, batch_size=[len(PROMPTS)]),
            good,
        ),
    ]
    if Capability.STOP_STRINGS not in s.capabilities:
        cases.append(
            (
                "stop_strings without stop_strings declared",
                prompt_batch(),
                good.model_copy(update={"stop_strings": ["ab"]}),
            )
        )
    if Capability.TOP_LOGPROBS not in s.capabilities:
        cases.append(
            (
                "top_logprobs without top_logprobs declared",
                prompt_batch(),
                good.model_copy(update={"top_logprobs": 2}),
            )
        )
    cases.append(
        (
            "an empty stop string (params built without validation)",
            prompt_batch(),
            SamplingParams.model_construct(**{**good.model_dump(), "stop_strings": [""]}),
        )
    )
    if Capability.ROUTING_REPLAY not in s.capabilities:
        cases.append(
            (
                "return_routes=True without routing_replay",
                prompt_batch(),
                good.model_copy(update={"return_routes": True}),
            )
        )
    for what, prompts, params in cases:
        try:
            s.rollout.generate(prompts, params)
        except (EngineCoreError, ValueError, TypeError):
            continue
        except Exception as e:  # raised from inside the backend, not refused up front
            raise PromiseBroken(
                "refusals",
                f"{what} was not refused: generating from it raised {type(e).__name__}: "
                f"{str(e)[:200]}.",
                "check the request before handing it to the backend: prompt_tensors(prompts, "
                "who, vocab_size) and self.check_params(params) (engine_core.rollout).",
            ) from e
        raise PromiseBroken(
            "refusals",
            f"{what} was generated from, not refused.",
            "check the request first: prompt_tensors(prompts, who, vocab_size) and "
            "self.check_params(params) (engine_core.rollout) refuse all of these.",
        )
    got, want = greedy_both(s.rollout, s.oracle, good.max_new_tokens)
    expect(
        got == want,
        "refusals",
        "after refusing bad input, greedy no longer matches the oracle.",
        "refuse before any state changes.",
    )


def check_capabilities(s: Subject) -> None:
    """The class declares (at least) what its registration says it can do."""
    missing = sorted(str(c) for c in set(s.registered) - set(s.capabilities))
    expect(
        not missing,
        "capabilities",
        f"registered with {missing}, which the rollout does not declare.",
        "declare one capability set and use it for the registration and the class.",
    )


def check_checksum_of_loaded(s: Subject) -> None:
    """``load_weights`` reports buckets whose checksum is the sender's."""
    done = _sync(s, s.initial)
    named = dict(sorted(s.initial.items()))
    for b in done:
        want = tensor_checksum((n, named[n]) for n in b.names)
        expect(
            b.checksum == want,
            "weight update",
            f"bucket {list(b.names)[:3]} reports checksum {b.checksum}, the sender's is {want}.",
            "return confirm_bucket(...) for every bucket.",
        )


CHECKS: dict[str, Callable[[Subject], None]] = {
    "capabilities": check_capabilities,
    "layout": check_layout,
    "greedy": check_greedy,
    "log_probs": check_log_probs,
    "top_k_top_p": check_top_k_top_p,
    "seeds": check_seeds,
    "sample_order": check_sample_order,
    "stop": check_stop,
    "stop_strings": check_stop_strings,
    "top_logprobs": check_top_logprobs,
    "weights": check_weights,
    "checksums": check_checksum_of_loaded,
    "release_resume": check_release_resume,
    "refusals": check_refusals,
    "async": check_async,
    "continuous": check_continuous,
    "lora": check_lora,
    "routes": check_routes,
    "weight_sync_group": check_weight_sync_group,
}
