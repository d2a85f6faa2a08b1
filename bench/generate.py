"""Offloaded generation: tiertrain against Hugging Face accelerate's disk offload and plain
in-memory `generate`, same model, prompts and greedy decoding, same run.

- tiertrain: `tiertrain.generate.generate`, the same weight budget as accelerate's kept in host
  memory (`memory.host_param_mib`, read once at the start of the timed call), the rest read unit
  by unit from the storage tier (`io.weights = tier`, converted once before the timed runs)
  through 3 slots, layer-major over the batch (`data.micro_batch_size` = the batch);
- accelerate: `from_pretrained(device_map="auto", max_memory={"cpu": WEIGHT_BUDGET},
  offload_folder=...)`, the layers past the budget offloaded to disk (what a user would pick);
- plain: the whole model in memory, `generate` (the floor where it fits).

Each run is its own process; tokens/s counts the generated tokens over the time of
`generate` (loading not counted); peak RSS is the process's VmHWM after loading, reset first.
The I/O floor at batch 1 is the weight bytes read per token over the storage tier's read
bandwidth measured in the same run (`tiertrain bench io`'s reader): all of them (the issue's
formula), and those outside the weight budget. A plot of tokens/s and peak RSS goes next to
``--out`` (``.png``).

A mixture of experts (``--family qwen3_moe`` and the other families of ``bench/moe.py``, its
``--shape``): tiertrain reads a block without its experts and only the experts the routing
reaches (``io.routed_experts``, the default), the hottest kept in the expert cache the weight
budget leaves; ``--layer-pieces N`` cuts each block into attention and N - 1 ranges of experts,
so that the slots follow the budget, not the block. The report adds the bytes a token against
two references, both counted from the plain run's own routing (a hook on each router): reading
every expert (the whole model each pass, as accelerate does) and the routed floor (each pass's
dense part plus the experts its tokens reached, each once).

    python bench/generate.py [--batches 1,16,64] [--new-tokens 8] [--layers 16] --out FILE
    python bench/generate.py --family qwen3_moe --shape layers=16,hidden=1024,experts=128,... --layer-pieces 5
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from deepspeed_worker import ProcMeter  # noqa: E402

from tiertrain.bench.output import SCRATCH_HELP, checked_out, publish, scratch_dir  # noqa: E402

SYSTEMS = {
    "tiertrain": "tiertrain (weights from the storage tier, 3 slots)",
    "accelerate": "accelerate disk offload (device_map auto, max_memory)",
    "plain": "plain transformers generate, all in memory",
}


def prompts_for(batch: int, length: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 31000 + 100 for j in range(length)] for i in range(batch)]


def worker(system: str, spec: dict) -> dict:
    import torch

    torch.manual_seed(0)
    meter = ProcMeter()
    prompts = prompts_for(spec["batch"], spec["prompt_len"])
    n = spec["new_tokens"]
    if system == "tiertrain":
        from tiertrain.config import load_config
        from tiertrain.inference.generate import Sampling, generate

        cfg = load_config(
            None,
            [
                f"--model.hf_dir={spec['model']}",
                f"--io.paths={spec['scratch']}",
                "--io.weights=tier",
                f"--data.micro_batch_size={spec['batch']}",
                "--train.device=cpu",
                "--memory.device_slots=3",
                f"--memory.host_param_mib={spec['budget_mib']}",
                *([f"--model.layer_pieces={spec['layer_pieces']}"] if spec.get("layer_pieces") else []),
            ],
        )
        generate(cfg, prompts[:1], Sampling(max_new_tokens=1))  # converts the weights once (not timed)
        meter.reset_peak()
        lines = _Lines()
        r0, t0 = meter.io()[0], time.perf_counter()
        with lines:
            out = generate(cfg, prompts, Sampling(max_new_tokens=n), eos=())
        extra = lines.counted()
    else:
        from transformers import AutoModelForCausalLM

        kw = dict(dtype=torch.float32)
        if system == "accelerate":
            kw.update(
                device_map="auto",
                max_memory={"cpu": f"{spec['budget_mib']}MiB"},
                offload_folder=os.path.join(spec["scratch"], "offload"),
            )
        model = AutoModelForCausalLM.from_pretrained(spec["model"], **kw).eval()
        model.config.output_router_logits = False  # transformers' generate fails with it
        ids = torch.tensor(prompts)
        with torch.no_grad():  # warm-up, as tiertrain's conversion call (not timed)
            model.generate(input_ids=ids[:1], max_new_tokens=1, do_sample=False, pad_token_id=0, eos_token_id=None)
        extra = _Routing(model) if system == "plain" else None
        meter.reset_peak()
        r0, t0 = meter.io()[0], time.perf_counter()
        with torch.no_grad():
            got = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        out = got[:, ids.shape[1] :].tolist()
        extra = extra.counted() if extra else {}
    seconds = time.perf_counter() - t0
    return dict(
        seconds=seconds,
        tokens=sum(map(len, out)),
        peak_rss=meter.peak_rss(),
        read=meter.io()[0] - r0,
        first=out[0],
        same=out,
        **extra,
    )


class _Lines(logging.Handler):
    """tiertrain's summary line of ``generate``: the bytes its storage tier counted, the experts reached."""

    _READ = re.compile(r"weights: (\d+) unit loads, ([\d.]+) GB read")
    _EXPERTS = re.compile(r"experts: (\d+) of (\d+) reached")

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> "_Lines":
        log = logging.getLogger("tiertrain")
        log.addHandler(self)
        log.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("tiertrain").removeHandler(self)

    def counted(self) -> dict:
        line = next(ln for ln in self.lines if ln.startswith("generated"))
        m, e = self._READ.search(line), self._EXPERTS.search(line)
        return dict(tier_gb=float(m.group(2)), **({"tier_reached": int(e.group(1))} if e else {}))


class _Routing:
    """The experts each forward pass of a mixture of experts reaches, counted from its routers'
    outputs (transformers' routers return the chosen experts' ids last): the routed floor's
    input, independent of tiertrain's own count."""

    def __init__(self, model) -> None:
        self.calls, self.reached = 0, 0
        self.hooks = [
            m.register_forward_hook(self._hook)
            for name, m in model.named_modules()
            if name.endswith("mlp.gate") or name.endswith("mlp.router")
        ]

    def _hook(self, module, args, out) -> None:
        if isinstance(out, tuple):
            self.calls += 1
            self.reached += int(out[-1].unique().numel())

    def counted(self) -> dict:
        for h in self.hooks:
            h.remove()
        return dict(router_calls=self.calls, reached=self.reached) if self.hooks else {}


class MemoryCgroup:
    """A memory cgroup (v1 or v2) limiting what a worker and its page cache may hold: a
    machine with less memory than the model, so that what is offloaded to disk is read from
    the disk and not from the page cache. A context manager; ``enter()`` runs in the child."""

    def __init__(self, limit_bytes: int) -> None:
        v1 = "/sys/fs/cgroup/memory"
        if os.path.isdir(v1):
            self.path, knob = os.path.join(v1, f"tiertrain-bench-{os.getpid()}"), "memory.limit_in_bytes"
        elif os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            self.path, knob = f"/sys/fs/cgroup/tiertrain-bench-{os.getpid()}", "memory.max"
        else:
            raise SystemExit("--memory-limit-mib: no memory cgroup here (neither /sys/fs/cgroup/memory nor cgroup v2)")
        try:
            os.makedirs(self.path, exist_ok=True)
            with open(os.path.join(self.path, knob), "w") as f:
                f.write(str(limit_bytes))
        except OSError as exc:
            raise SystemExit(
                f"--memory-limit-mib: cannot make a memory cgroup at {self.path} ({exc}); run as root, "
                "or leave the limit out"
            ) from None

    def enter(self) -> None:
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def __enter__(self) -> "MemoryCgroup":
        return self

    def __exit__(self, *exc) -> None:
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def drop_cached(root: str) -> None:
    """Drop the page cache of every file under ``root`` (the model's weights, the offload
    folder): a run starts with its weights on the disk, not in memory left by the last one."""
    for d, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run(system: str, spec: dict, limit_bytes: int | None = None) -> dict:
    if limit_bytes:
        drop_cached(spec["scratch"])
    path = os.path.join(spec["scratch"], "spec.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    cmd = [sys.executable, __file__, "--worker", system, path]
    if limit_bytes:
        with MemoryCgroup(limit_bytes) as cg:
            p = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=cg.enter)
    else:
        p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{system} at batch {spec['batch']} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def make_model(directory: str, args) -> tuple[int, int]:
    """The model, random (seed 0), saved in ``directory``: its parameter count and, for a
    mixture of experts, the parameters of one expert of one layer (else 0)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tiertrain.config import ModelConfig
    from tiertrain.models import hf_config_from

    torch.manual_seed(0)
    if args.family != "llama":
        from moe import write_config

        write_config(args.family, args.moe_shape, args.prompt_len + args.new_tokens, directory)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
        model.save_pretrained(directory)
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        shape = args.moe_shape
        return sum(p.numel() for p in model.parameters()), experts // (shape["layers"] * shape["experts"])
    cfg = hf_config_from(
        ModelConfig(
            kind="llama",
            n_layers=args.layers,
            d_model=args.d_model,
            n_heads=args.d_model // 128,
            d_ff=args.d_ff,
            vocab_size=32000,
            max_seq_len=256,
        )
    )
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters()), 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=1536)
    ap.add_argument("--d-ff", type=int, default=4096)
    ap.add_argument(
        "--budget-mib",
        type=int,
        default=512,
        help="weights kept in host memory: accelerate's max_memory (CPU), tiertrain's memory.host_param_mib",
    )
    ap.add_argument("--systems", default="tiertrain,accelerate,plain")
    ap.add_argument(
        "--family", default="llama", help="llama (dense), or a mixture of experts: qwen3_moe, mixtral, olmoe, qwen2_moe"
    )
    ap.add_argument("--shape", default="", help="a mixture of experts' shape: overrides of bench/moe.py's SHAPE")
    ap.add_argument(
        "--layer-pieces", type=int, default=None, help="tiertrain's model.layer_pieces (N > 2: experts in N - 1 ranges)"
    )
    ap.add_argument(
        "--memory-limit-mib",
        type=int,
        default=None,
        help="run the offloading systems in a memory cgroup of this size (page cache included): a machine "
        "with less memory than the model, so that offloaded weights come from the disk (plain runs "
        "without: it needs the whole model)",
    )
    ap.add_argument("--scratch", default=None, help=SCRATCH_HELP)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    from moe import SHAPE

    args.moe_shape = dict(SHAPE, **{k: int(v) for k, v in (kv.split("=") for kv in args.shape.split(",") if kv)})
    if args.worker:
        with open(args.worker[1]) as f:
            print(json.dumps(worker(args.worker[0], json.load(f))))
        return 0
    out = checked_out(args.out) if args.out else None
    systems = args.systems.split(",")
    with scratch_dir(args.scratch, "generate") as scratch:
        model = os.path.join(scratch, "model")
        n_params, expert_params = make_model(model, args)
        from tiertrain.bench.io import run_io_bench

        io = run_io_bench([scratch], size_bytes=1 << 30, repeats=2, use_fio=False, progress=False)
        read_gbps = io.median("ours", "read")
        rows = {}
        for b in map(int, args.batches.split(",")):
            for s in systems:
                spec = dict(
                    model=model,
                    scratch=scratch,
                    batch=b,
                    new_tokens=args.new_tokens,
                    prompt_len=args.prompt_len,
                    budget_mib=args.budget_mib,
                    layer_pieces=args.layer_pieces,
                )
                print(f"batch {b}: {s} ...", flush=True)
                limit = args.memory_limit_mib << 20 if args.memory_limit_mib and s != "plain" else None
                rows[b, s] = run(s, spec, limit)
                print(f"  {rows[b, s]['tokens'] / rows[b, s]['seconds']:.1f} tok/s", flush=True)
    text = render(rows, systems, args, n_params, read_gbps)
    if expert_params:
        text += render_routed(rows, args, n_params, expert_params)
    publish(text, out)
    if out:
        plot(rows, systems, os.path.splitext(out)[0] + ".png")
    return 0


def plot(rows: dict, systems: list[str], path: str) -> None:
    """Tokens/s (log scale) and peak RSS per batch, one bar per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({b for b, _ in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(systems)
    for i, s in enumerate(systems):
        xs = [j + i * width for j in range(len(batches))]
        axes[0].bar(xs, [rows[b, s]["tokens"] / rows[b, s]["seconds"] for b in batches], width, label=s)
        axes[1].bar(xs, [rows[b, s]["peak_rss"] / 2**30 for b in batches], width, label=s)
    for ax, title in zip(axes, ("tokens/s (log)", "peak RSS, GiB")):
        ax.set_xticks(
            [j + width * (len(systems) - 1) / 2 for j in range(len(batches))], [f"batch {b}" for b in batches]
        )
        ax.set_title(title)
    axes[0].set_yscale("log")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def render_routed(rows: dict, args, n_params: int, expert_params: int) -> str:
    """Bytes a generated token for a mixture of experts: tiertrain's storage tier against reading
    every expert and against the routed floor, both from the plain run's routing."""
    shape = args.moe_shape
    expert_b = expert_params * 4
    dense_b = n_params * 4 - shape["layers"] * shape["experts"] * expert_b
    lines = [
        "",
        f"Bytes a token (fp32; one expert of one layer {expert_b / 2**20:.2f} MiB, the dense part "
        f"{dense_b / 1e9:.3f} GB; counted over the timed call, prefill included). Every expert: the whole "
        "model each pass. Routed floor: each pass's dense part and the experts its tokens reached, each once "
        "(from the plain run's routers). tiertrain: what its storage tier read (the weight budget and the "
        "expert cache serve the rest).",
        "",
        "| batch | passes | experts reached (plain / tiertrain) | every expert MB/token | routed floor MB/token | "
        "tiertrain MB/token | tiertrain / routed floor |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in sorted({b for b, _ in rows}):
        plain, ours = rows.get((b, "plain")), rows.get((b, "tiertrain"))
        if not plain or not ours or "reached" not in plain:
            continue
        passes = plain["router_calls"] // shape["layers"]
        every = passes * n_params * 4
        floor = passes * dense_b + plain["reached"] * expert_b
        tier = ours["tier_gb"] * 1e9
        tok = ours["tokens"]
        lines.append(
            f"| {b} | {passes} | {plain['reached']} / {ours.get('tier_reached', '-')} | {every / tok / 1e6:.1f} | "
            f"{floor / tok / 1e6:.1f} | {tier / tok / 1e6:.1f} | {tier / floor:.2f}x (goal <= 1.2x) |"
        )
    return "\n".join(lines) + "\n"


def render(rows: dict, systems: list[str], args, n_params: int, read_gbps: float) -> str:
    weight_gb = n_params * 4 / 1e9
    lines = [
        f"# Offloaded generation, {time.strftime('%Y-%m-%d')}",
        "",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, no GPU; storage tier read {read_gbps:.2f} GB/s "
        "(measured in this run)",
        (
            f"- model: Llama, {n_params / 1e6:.0f} M parameters ({args.layers} layers, d {args.d_model}, ff {args.d_ff}), "
            if args.family == "llama"
            else f"- model: {args.family}, {n_params / 1e6:.0f} M parameters ("
            + ", ".join(f"{k} {v}" for k, v in args.moe_shape.items())
            + (f"; tiertrain's model.layer_pieces = {args.layer_pieces}" if args.layer_pieces else "")
            + "), "
        )
        + f"fp32 ({weight_gb:.2f} GB of weights), random; prompts of {args.prompt_len} tokens, {args.new_tokens} new "
        "tokens, greedy",
        f"- weight budget: {args.budget_mib} MiB of CPU memory for both (accelerate's max_memory, tiertrain's "
        "memory.host_param_mib, loaded inside the timed call), the rest offloaded to disk; tiertrain: 3 slots of "
        "the largest unit",
        (
            f"- the offloading systems ran in a memory cgroup of {args.memory_limit_mib} MiB (page cache included): "
            "a machine with less memory than the model, so what is offloaded is read from the disk (the weights' "
            "page cache dropped before each run: pages cached outside a cgroup are not its to evict)"
            if args.memory_limit_mib
            else "- no memory limit: accelerate's offloaded weights may be served from the "
            "page cache (this machine's RAM holds them), not the disk"
        ),
        "",
        "| batch | system | tokens/s | vs accelerate | vs plain | peak RSS GiB | disk read GB | first row's tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b in sorted({b for b, _ in rows}):
        base = rows.get((b, "accelerate"))
        plain = rows.get((b, "plain"))
        for s in systems:
            r = rows[b, s]
            tps = r["tokens"] / r["seconds"]
            va = f"{tps / (base['tokens'] / base['seconds']):.2f}x" if base else "-"
            vp = f"{tps / (plain['tokens'] / plain['seconds']):.2f}x" if plain else "-"
            lines.append(
                f"| {b} | {SYSTEMS[s]} | {tps:.1f} | {va} | {vp} | {r['peak_rss'] / 2**30:.2f} | "
                f"{r['read'] / 1e9:.2f} | {r['first']} |"
            )
    one = rows.get((1, "tiertrain"))
    if one:
        floor = weight_gb / read_gbps  # seconds per token at batch 1: every weight read once per token
        per_token = one["seconds"] / one["tokens"]
        streamed = max(0.0, weight_gb - args.budget_mib * 2**20 / 1e9)
        lines += [
            "",
            f"At batch 1 the I/O floor is {weight_gb:.2f} GB per token / {read_gbps:.2f} GB/s = {floor:.2f} s per "
            f"token; tiertrain takes {per_token:.2f} s per token ({per_token / floor:.2f}x the floor; the prefill is "
            f"in it). Counting only the {streamed:.2f} GB outside the weight budget: floor "
            f"{streamed / read_gbps:.2f} s, tiertrain at {per_token / (streamed / read_gbps):.2f}x it. tiertrain's "
            f"reads ran at {one['read'] / one['seconds'] / 1e9:.2f} GB/s (disk read / time): where that is above "
            "the measured bandwidth, the floor's bandwidth is the pessimistic one (the disk is noisy).",
        ]
    for b in sorted({b for b, _ in rows}):
        per = {s: rows[b, s]["seconds"] / rows[b, s]["tokens"] for s in systems if (b, s) in rows}
        if "tiertrain" in per and "plain" in per:
            line = (
                f"- batch {b}: tiertrain's time per token is {per['tiertrain'] / per['plain']:.2f}x in-memory "
                "generate's (goal at batch >= 16: <= 1.5x)"
            )
            if "accelerate" in per:
                line += f"; accelerate's is {per['accelerate'] / per['tiertrain']:.2f}x tiertrain's (goal: >= 10x)"
            lines.append(line)
    same = all(rows[b, s]["same"] == rows[b, systems[0]]["same"] for b, s in rows)
    lines += ["", f"Greedy tokens of every prompt identical across systems: {'yes' if same else 'NO'}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
