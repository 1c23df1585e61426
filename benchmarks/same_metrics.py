"""Does a change leave what the jobs compute as it was? Every shipped recipe, a few steps each,
colocated, with rollout replicas in processes of their own, with a dp=2 actor group and
asynchronous, every metric of every step recorded (timing keys aside).

``python benchmarks/same_metrics.py --save before.json`` on the tree before a change, then
``python benchmarks/same_metrics.py --against before.json`` on the tree after it: the second
prints, for each case, ``equal`` or the first differing step and keys, and exits 1 when any case
differs. ``--only grpo_tiny,text_tiny/dp2`` restricts the cases (a recipe, or recipe/case).

Each case runs ``engine-core run`` (``engine-core train`` for the SFT recipes) as a user does,
in a subprocess of its own, for ``--steps`` steps (default 4) with a row every step, into a
temporary folder. Values are compared exactly: the jobs are deterministic for a seed, and a
refactoring is meant to change no value, bit for bit. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_core.launch import caller_environment

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "roles" / "engine_core_roles" / "recipes"
# Rows keys that measure time (engine_core_roles.trainer.metrics.TIMING_KEYS, read from there
# below) differ between identical runs; the SFT job's "time_s" is one of them.

PLACEMENTS: dict[str, list[str]] = {
    "colocated": [],
    "replicas": ["rollout_placement=process", "rollout_replicas=2"],
    "dp2": ["placement.executor=local", "placement.actor.dp=2"],
    "async": ["rollout_placement=process", "trainer.max_staleness=1"],
}
# every placement on the two default recipes (token ids, and text through a tokenizer); the
# other recipes colocated (their algorithms, tasks and models differ, not their placement)
ALL_PLACEMENTS = ("grpo_tiny", "text_tiny")
SFT = ("sft_tiny", "sft_text_tiny")


def cases() -> dict[str, tuple[str, list[str]]]:
    """``name -> (command, arguments)`` for every case."""
    out: dict[str, tuple[str, list[str]]] = {}
    for path in sorted(RECIPES.glob("*.yaml")):
        recipe = path.stem
        if recipe in SFT:
            out[recipe] = ("train", [str(path)])
            continue
        for place, extra in PLACEMENTS.items():
            if place != "colocated" and recipe not in ALL_PLACEMENTS:
                continue
            name = recipe if place == "colocated" else f"{recipe}/{place}"
            out[name] = ("run", [str(path), *extra])
    return out


def _clean(value: Any) -> Any:
    # NaN != NaN: compare it as a string so an unchanged NaN counts as equal
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


def run_case(command: str, args: list[str], steps: int) -> list[dict[str, Any]]:
    """Every row of the case's metrics file, timing keys dropped."""
    from engine_core_roles.trainer.metrics import TIMING_KEYS

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "run")
        overrides = [f"output_dir={out}", f"steps={steps}", "log_every=1", f"save_every={steps}"]
        cmd = [sys.executable, "-m", "engine_core.cli", command, *args, *overrides]
        env = {**caller_environment(), "RAY_AUTH_MODE": "disabled"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
                f"\n{proc.stderr[-3000:]}"
            )
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    return [{k: _clean(v) for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def first_difference(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> str | None:
    """A sentence naming the first step and keys where ``b`` differs from ``a``; None if equal."""
    if len(a) != len(b):
        return f"{len(b)} rows against {len(a)}"
    for i, (ra, rb) in enumerate(zip(a, b, strict=True)):
        if ra == rb:
            continue
        keys = sorted(set(ra) ^ set(rb))
        changed = sorted(k for k in set(ra) & set(rb) if ra[k] != rb[k])
        step = ra.get("step", i)
        parts = []
        if keys:
            parts.append(f"keys only on one side: {keys}")
        if changed:
            shown = ", ".join(f"{k}: {ra[k]!r} -> {rb[k]!r}" for k in changed[:5])
            parts.append(f"{len(changed)} values differ ({shown})")
        return f"step {step}: " + "; ".join(parts)
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--save", help="write the rows of every case to this JSON file")
    p.add_argument("--against", help="compare with the rows a --save wrote")
    p.add_argument("--only", default="", help="comma-separated recipes or recipe/case names")
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()
    wanted = [w for w in a.only.split(",") if w]
    chosen = {
        n: c for n, c in cases().items() if not wanted or n in wanted or n.split("/")[0] in wanted
    }
    base = json.loads(Path(a.against).read_text()) if a.against else None
    rows: dict[str, list[dict[str, Any]]] = {}
    verdicts: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for name, (command, args) in chosen.items():
        start = time.perf_counter()
        rows[name] = run_case(command, args, a.steps)
        seconds[name] = round(time.perf_counter() - start, 1)
        if base is not None:
            if name not in base["rows"]:
                verdicts[name] = "not in the baseline"
            else:
                diff = first_difference(base["rows"][name], rows[name])
                verdicts[name] = "equal" if diff is None else diff
        print(f"{name}: {verdicts.get(name, 'recorded')} ({seconds[name]} s)", file=sys.stderr)
    if a.save:
        Path(a.save).write_text(json.dumps({"steps": a.steps, "rows": rows}, indent=1))
    result: dict[str, Any] = {"steps": a.steps, "seconds": seconds}
    if base is not None:
        result["verdicts"] = verdicts
        result["all_equal"] = all(v == "equal" for v in verdicts.values())
    print(json.dumps(result, indent=1))
    return 0 if base is None or result["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
