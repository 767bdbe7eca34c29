"""The walk of one sample through the code, as a reader following its calls meets the files.

    python scripts/sample_walk.py [--methods full,centroidkv,snapkv] [--budget 0.5] [--show]

One toy sample on a tiny random model goes through `Evaluator.iter_sample` under a profiler. Each
function of centroidkv/, eval/ or baselines/ counts at its first call only (a reader reads it once):
the reader walks from the caller's file (its nearest frame in those folders; a model's forward in
between is the library calling back) into the callee's file, and back to the caller's file for its
next call. The files are the rooms of the walk; it prints
- stays: the rooms in the order the reader is in them (consecutive calls in one file are one stay),
  over every function, and over the path only (functions that call into another file: a helper
  that calls nothing outside its own file is a definition looked up, not a step of the walk),
- returns: stays in a room the reader had already left (coming back to a caller counts),
- climbs back up: calls into a file that imports the caller's file (directly or not): a callback
  against the import picture of `tests/test_import_cycles.py`, where layers import downwards only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
FOLDERS = ("centroidkv", "eval", "baselines")


def room_of(filename: str) -> str | None:
    """The repository file a code object belongs to (`centroidkv/plan/plan.py`), None outside the folders."""
    path = Path(filename)
    if not path.is_absolute() or ROOT not in path.parents:
        return None
    relative = path.relative_to(ROOT)
    return str(relative) if relative.parts[0] in FOLDERS else None


Call = tuple[str, tuple[str, int], str, tuple[str, int], str]  # caller's room and code, callee's, name


def first_calls(action: Callable[[], Any]) -> list[Call]:
    """The first call of each function of the folders while `action` runs, in order: (caller's room,
    caller's code, callee's room, callee's code, callee's name); a code is (file, first line)."""
    seen: set[tuple[str, int]] = set()
    calls: list[Call] = []

    def profile(frame: FrameType, event: str, _: Any) -> None:
        if event != "call":
            return
        room = room_of(frame.f_code.co_filename)
        key = (frame.f_code.co_filename, frame.f_code.co_firstlineno)
        if room is None or key in seen:
            return
        seen.add(key)
        caller = frame.f_back
        while caller is not None and room_of(caller.f_code.co_filename) is None:
            caller = caller.f_back
        if caller is not None:
            caller_code = (caller.f_code.co_filename, caller.f_code.co_firstlineno)
            calls.append(
                (room_of(caller.f_code.co_filename), caller_code, room, key, frame.f_code.co_qualname)
            )

    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
    return calls


def module_of(room: str) -> str:
    parts = Path(room).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(graph: dict[str, set[str]], module: str) -> set[str]:
    """Every module `module` imports, directly or not."""
    found, todo = set(), [module]
    while todo:
        for imported in graph.get(todo.pop(), ()):
            if imported not in found:
                found.add(imported)
                todo.append(imported)
    return found


def paths_only(calls: list[Call]) -> list[Call]:
    """The calls into functions that themselves call into another file: the path a reader follows,
    without the definitions looked up on the way (a helper that calls nothing outside its file)."""
    onward = {caller_code for caller, caller_code, callee, _, _ in calls if caller != callee}
    return [call for call in calls if call[3] in onward]


def walk(calls: list[Call], graph: dict[str, set[str]]) -> dict[str, Any]:
    """The stays, returns and climbs of the reader's walk through `calls` (module docstring)."""
    stays: list[str] = []
    climbs = []
    for caller, _, callee, _, name in calls:
        for room in (caller, callee):
            if not stays or stays[-1] != room:
                stays.append(room)
        if caller != callee and module_of(caller) in imports_of(graph, module_of(callee)):
            climbs.append(f"{caller} -> {callee} ({name})")
    returns = sum(room in stays[:i] for i, room in enumerate(stays))
    return {"stays": stays, "returns": returns, "climbs": climbs}


def one_sample(methods: list[str], budget: float) -> Callable[[], list[dict]]:
    """A toy sample through `Evaluator.iter_sample` on tiny-llama (everything loaded beforehand)."""
    from centroidkv import load_model, load_tokenizer
    from eval.benchmarks.toy import Toy
    from eval.evaluate import Evaluator
    from eval.run_config import MethodSpec

    model, tokenizer = load_model("tiny-llama")[0], load_tokenizer("smollm2-135m")
    specs = [MethodSpec(name, 1.0 if name == "full" else budget) for name in methods]
    benchmark = Toy(lengths=(256,), n_samples=1)
    evaluator = Evaluator(model, tokenizer, tuple(specs), benchmark)
    sample = benchmark.samples(tokenizer)[0]
    evaluator.warm_up()
    return lambda: list(evaluator.iter_sample(sample, specs, 8))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--methods", default="full,centroidkv,snapkv")
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--show", action="store_true", help="print the stays and the climbs")
    args = parser.parse_args(argv)
    from centroidkv.cache.budget import check_budget
    from centroidkv.errors import refused_in_one_line
    from centroidkv.methods import check_method_names
    from tests.test_import_cycles import import_graph

    with refused_in_one_line(parser):  # everything is checked before a model is built
        check_budget(args.budget)
        check_method_names(args.methods.split(","), "--methods")

    action = one_sample(args.methods.split(","), args.budget)
    records = []
    calls = first_calls(lambda: records.extend(action()))
    if any(record["status"] != "ok" for record in records):
        print(f"error: a record failed: {records}", file=sys.stderr)
        return 1
    graph = import_graph(ROOT)
    for what, counted in (("every function", calls), ("the path (helpers not followed)", paths_only(calls))):
        found = walk(counted, graph)
        if args.show:
            print("\n".join(f"  {room}" for room in found["stays"]))
            print("\n".join(f"  climb: {climb}" for climb in found["climbs"]))
        print(
            f"{what}: stays {len(found['stays'])}, returns {found['returns']}, "
            f"climbs back up {len(found['climbs'])}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
