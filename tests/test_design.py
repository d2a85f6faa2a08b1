"""The seams of the redesign: state declared by its owner (and nothing else checkpointed or
made), the update interface, typed engine messages and checked state machines."""

import dataclasses
import os

import pytest
import torch
from reference import assert_resume_exact, small_config

from tiertrain.checkpoint import Manifest
from tiertrain.state.machine import IllegalTransition
from tiertrain.training.trainer import Trainer

CONFIGS = {
    "baseline fp32": dict(),
    "baseline bf16, host budgets": dict(dtype="bfloat16", host_param_mib=1, grad_host_mib=1),
    "sgd": dict(optim="sgd"),
    "engines, 2 paths": dict(mode="engines", paths=2),
    "engines, top-k with error feedback": dict(mode="engines", topk=0.1, error_feedback=True),
}


def make(tmp_path, *, mode="baseline", optim="adamw", topk=0.0, error_feedback=False, **kw):
    cfg = small_config(tmp_path, micro_batches=2, steps=3, **kw)
    cfg.update.mode, cfg.optim.name = mode, optim
    cfg.update.topk, cfg.update.error_feedback = topk, error_feedback
    return cfg


def region_bytes(tr) -> dict[str, list[bytes]]:
    """Every checkpointed state's bytes, unit by unit, as its region gives them."""
    out = {}
    with tr.state_regions() as regions:
        for name, r in regions.items():
            buf = torch.empty(tr.layout.max_unit_numel, dtype=r.dtype)
            units = []
            for unit in tr.layout.units:
                r.read(unit.index, buf, 0, unit.numel).get()
                units.append(buf[: unit.numel].view(torch.uint8).numpy().tobytes())
            out[name] = units
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_declared_checkpointed_state_survives_save_and_restore(tmp_path, name):
    """A state that is declared checkpointed but not saved, or saved but not restored, fails
    here; so does a file the run makes that no declaration names."""
    cfg = make(tmp_path, **CONFIGS[name])
    with Trainer(cfg) as tr:
        declared = {d.name for d in tr.plan.states if d.checkpointed}
        for d in tr.plan.states:  # every declared file exists, with its declared size (striped: over its paths)
            for f in d.files:
                on = [os.path.join(p, f.name) for p in ([f.path] if f.path else cfg.io.paths)]
                assert sum(os.path.getsize(x) for x in on) == f.size, (d.name, f.name)
        made = {n for p in cfg.io.paths for n in os.listdir(p) if not n.endswith(".crc") and not n.startswith(".")}
        assert made <= set(tr.plan.names), made - set(tr.plan.names)  # nothing undeclared
        tr.initialize(progress=False)
        for _ in range(2):
            tr.train_step()
        before = region_bytes(tr)
        saved = tr.save_checkpoint()
    assert set(before) == {f"{n}.bin" for n in declared}
    man = Manifest.read(saved.path)
    assert {f.name for f in man.files} == {f"{n}.bin" for n in declared} | {"rng.safetensors"}
    with Trainer(make(tmp_path / "fresh", **CONFIGS[name])) as tr:
        tr.restore(saved.path)
        after = region_bytes(tr)
    assert after.keys() == before.keys()
    for state in before:
        assert after[state] == before[state], state
    if CONFIGS[name].get("error_feedback"):
        assert "residual.bin" in before and any(any(u) for u in before["residual.bin"])


def test_a_forgotten_region_is_refused(tmp_path, monkeypatch):
    """The update must give exactly its declared checkpointed states: one left out is an
    error at the first save, not a checkpoint that silently lacks it."""
    import contextlib

    cfg = make(tmp_path)
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        real = tr.update.regions

        @contextlib.contextmanager
        def short():
            with real() as regions:
                yield {k: v for k, v in regions.items() if k != "exp_avg_sq"}

        monkeypatch.setattr(tr.update, "regions", short)
        with pytest.raises(RuntimeError, match=r"checkpointed states declared .*'exp_avg_sq'.*, the update gives"):
            tr.save_checkpoint()


@pytest.mark.slow
def test_resume_with_error_feedback_is_bit_identical(tmp_path):
    """The residual is checkpointed: 2 + 2 steps across a save and a fresh trainer give the
    losses and weights of 4 straight steps (before, the residual restarted at zero)."""
    kw = dict(mode="engines", topk=0.1, error_feedback=True)
    assert_resume_exact(make(tmp_path / "a", **kw), make(tmp_path / "b", **kw))


def test_the_trainer_holds_one_update_and_never_asks_its_kind():
    """No update-mode branch in the trainer: it reaches the update path through its interface."""
    import re

    src = open(os.path.join(os.path.dirname(__file__), "..", "tiertrain", "training", "trainer.py")).read()
    uses = re.findall(r".{0,12}update\.mode.{0,2}", src)
    assert uses and all(u.endswith("UPDATES[cfg.update.mode]") or "UPDATES[cfg.update.mode]" in u for u in uses), uses
    assert "isinstance(self.update" not in src and "EngineUpdate" not in src and "BaselineUpdate" not in src


def test_the_trainer_has_one_path_whatever_the_number_of_ranks():
    """One process is a group of one: the training package never asks how many ranks there are
    (the group wraps what differs), as it never asks which update path it holds."""
    import glob
    import re

    pkg = os.path.join(os.path.dirname(__file__), "..", "tiertrain", "training")
    for path in glob.glob(os.path.join(pkg, "*.py")):
        src = open(path).read()
        found = re.findall(
            r".{0,30}(?:world\s*[=!<>]=?\s*1|world\s*>\s*\d|group is (?:not )?None|rank\s*==\s*0"
            r"|ShardedParams|ShardedGrads|GatheredRegion|ScatteredRegion).{0,10}",
            src,
        )
        assert not found, (os.path.basename(path), found)


def test_slot_and_engine_state_machines_refuse_illegal_moves():
    from tiertrain.state.store import _SLOT, SlotState
    from tiertrain.update.engines.protocol import ENGINE, EngineState

    assert _SLOT.move(SlotState.FREE, SlotState.LOADING) == SlotState.LOADING
    with pytest.raises(
        IllegalTransition, match=r"parameter slot 1: BOUND -> FREE is not allowed \(from BOUND: RESIDENT\)"
    ):
        _SLOT.move(SlotState.BOUND, SlotState.FREE, "1")
    with pytest.raises(IllegalTransition, match=r"parameter slot: FREE -> BOUND is not allowed"):
        _SLOT.move(SlotState.FREE, SlotState.BOUND)
    assert ENGINE.move(EngineState.READY, EngineState.RELEASED) == EngineState.RELEASED
    with pytest.raises(IllegalTransition, match=r"update engine 0: STARTING -> RELEASED is not allowed"):
        ENGINE.move(EngineState.STARTING, EngineState.RELEASED, "0")
    with pytest.raises(IllegalTransition, match=r"STOPPED -> READY is not allowed \(from STOPPED: none\)"):
        ENGINE.move(EngineState.STOPPED, EngineState.READY)


def test_engine_messages_are_frozen_and_reports_typed():
    from tiertrain.update.engines import protocol as P

    m = P.Grad(unit=3, slot=1, step=7, lr=1e-3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.unit = 4
    r = P.StepReport(
        seconds=1.0,
        read=2,
        written=3,
        wait_s=0.0,
        compute_s=0.5,
        ahead=0,
        chunks=4,
        cpu_s=0.9,
        peak_host=5,
        base_host=1,
        pool=2,
    )
    assert r["chunks"] == 4 and r.chunks == 4
    with pytest.raises(KeyError):
        r["nope"]


def test_requires_python_matches_the_standard_library_the_code_uses():
    """config.py reads TOML with tomllib (3.11+): pyproject must not promise less."""
    import re
    import tomllib

    root = os.path.join(os.path.dirname(__file__), "..")
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        spec = tomllib.load(f)["project"]["requires-python"]
    low = tuple(int(x) for x in re.search(r">=\s*(\d+)\.(\d+)", spec).groups())
    assert "import tomllib" in open(os.path.join(root, "tiertrain", "config", "__init__.py")).read()
    assert low >= (3, 11), spec


def _import_graph(deep: bool = False):
    """Module-level imports between tiertrain's modules (with ``deep``, also those in
    ``TYPE_CHECKING`` blocks and inside functions, which are not imports at load time but still
    knit the modules together), an import of ``a.b.c`` counting ``a`` and ``a.b`` too; a
    module's own packages are left out (a package importing its modules is no circle)."""
    import ast

    root = os.path.join(os.path.dirname(__file__), "..", "tiertrain")
    mods = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                p = os.path.join(d, f)
                name = os.path.relpath(p, os.path.dirname(root))[:-3].replace(os.sep, ".")
                mods[name.removesuffix(".__init__")] = p
    graph = {}
    for m, p in mods.items():
        pkg = m.split(".") if p.endswith("__init__.py") else m.split(".")[:-1]
        deps = set()
        tree = ast.parse(open(p).read())
        for node in ast.walk(tree) if deep else tree.body:
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                base = pkg[: len(pkg) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                deps |= {f"{target}.{a.name}" for a in node.names} | {target}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        for d in list(deps):
            parts = d.split(".")
            deps |= {".".join(parts[:k]) for k in range(1, len(parts))}
        own = {".".join(m.split(".")[:k]) for k in range(1, m.count(".") + 2)}
        graph[m] = {d for d in deps if d in mods and d not in own}
    return graph


def _circles(graph):
    state, stack, circles = {}, [], []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                circles.append(stack[stack.index(v) :] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return circles


def test_the_import_graph_has_no_circle_and_the_runtime_no_update_path():
    graph = _import_graph()
    assert not _circles(graph), _circles(graph)[:5]
    seen, todo = set(), ["tiertrain.runtime"]
    while todo:  # everything the runtime loads with it
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph[m]
    assert not [m for m in seen if m.startswith("tiertrain.update")], sorted(seen)


def test_the_cost_model_names_no_update_path():
    """The planner and the cost model ask an update path what it is (``Update.auto_candidate``,
    ``fixed_pools``, ``predict_step`` ...), through the registry: they never name one."""
    import glob
    import re

    graph = _import_graph()
    for path in glob.glob(os.path.join(os.path.dirname(__file__), "..", "tiertrain", "cost", "*.py")):
        src = open(path).read()
        named = re.findall(r"""["'](?:baseline|overlap|engines)["']|update\.mode\s*[=!]=\s*["'](?!auto)""", src)
        assert not named, (os.path.basename(path), named)
        mod = "tiertrain.cost." + os.path.basename(path)[:-3]
        inner = [
            d
            for d in graph.get(mod.removesuffix(".__init__"), ())
            if d.startswith("tiertrain.update.")
            and d
            not in (
                "tiertrain.update.base",
                "tiertrain.update.streamed",
                "tiertrain.update.kernels",
                "tiertrain.update.adamw8bit",
            )
        ]  # the interface and what every path shares (the streamed update and its arithmetic)
        assert not inner, (mod, inner)


def test_modules_stay_small_and_the_engine_seams_use_the_clients_public_calls():
    """One module per concern, each a file a reader holds in their head (under about 600
    lines); the seams through which the trainer reaches the engines (seams.py) call the
    client's public methods, never its private fields."""
    import glob
    import re

    root = os.path.join(os.path.dirname(__file__), "..", "tiertrain")
    sizes = {
        os.path.relpath(p, root): sum(1 for _ in open(p))
        for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
    }
    assert {p: n for p, n in sizes.items() if n > 650} == {}
    seams = open(os.path.join(root, "update", "engines", "seams.py")).read()
    assert not re.findall(r"\b(?:g|group)\._[a-z]\w*", seams)


def test_no_circle_even_through_imports_inside_functions_or_for_annotations():
    """An import deferred into a function or a ``TYPE_CHECKING`` block only hides a circle from
    the interpreter: the modules still need each other. There is none."""
    circles = _circles(_import_graph(deep=True))
    assert not circles, circles[:5]
