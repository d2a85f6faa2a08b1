"""LoRA on a frozen model larger than memory: tiertrain against its I/O floor and against plain
peft in memory.

1. **The big model**: a Llama of ``--big`` shape (default 33 x 2560: 2.46 B parameters) made
   with transformers' ``save_pretrained`` in bf16 (4.9 GB; in fp32 training with AdamW it would
   need 39 GB, 1.6x this machine's RAM). tiertrain trains LoRA (rank 16 on every projection) on it,
   the base kept in bf16 on the storage tier (``model.base_dtype``), fp32 compute, within a host
   budget of ``--host-mib``. Reported: peak RSS of the training process, s/step, bytes read per
   step, and the floors: I/O = two reads of the base at the rate probed in the same process
   before training; compute = a forward and backward of every unit in memory at this batch (the
   cost model's unit timings). tiertrain's step against max(I/O, compute).
2. **The peer**: a smaller Llama (``--peer``) that plain PyTorch + peft trains in memory (fp32,
   ``inject_adapter_in_model``, fused AdamW): its s/step and peak RSS; then tiertrain on the
   same model, data shape and LoRA with its peak RSS aimed at a fifth of peft's: the host budget
   is that less what the process holds before training (interpreter, torch, transformers) and
   the allocator's slack above the budget (``RSS_SLACK_MIB``). ``--skip-big``: only this. The
   base on the tier in ``--peer-base-dtype``: the compute dtype by default (fp32 on CPU, nothing
   to widen), or bf16 (half the bytes, the same math here: the model was saved in bf16 and
   peft's fp32 copy is its exact upcast; widened on the compute's cores). ``--rounds`` runs the
   pair that many times, alternated (the machine drifts between minutes). Each run in its own
   process (peak RSS is per process).

3. **DeepSpeed** ZeRO-3 with every parameter on NVMe + peft's LoRA on the big model (fp32, the
   same LoRA, batch shape and clipping; ``bench/deepspeed_worker.py lora``), where an interpreter
   with DeepSpeed is given (``--ds-python``; DeepSpeed is an optional benchmark dependency):
   s/step, peak RSS, bytes read a step; or what happened where it does not run.

Usage: python bench/lora.py [--steps 3] [--host-mib 2048] [--scratch DIR] [--out FILE]
                            [--big LAYERSxD] [--peer LAYERSxD] [--skip-peer] [--ds-python PATH]
                            [--seq 64] [--micro-batches 2] [--device cpu|cuda]
                            [--peer-base-dtype compute|bfloat16] [--rounds 1] [--skip-big]
                            [--set SECTION.FIELD=VALUE ...] [--family llama|qwen2]

On a GPU (``--device cuda``) tiertrain computes in bf16 (its default there) and peft trains
the peer in device memory in bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

from tiertrain.bench.output import SCRATCH_HELP, checked_out, publish, scratch_dir

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEQ, MBS, M = 64, 1, 2  # tokens per micro-batch row, rows, micro-batches per step
RSS_SLACK_MIB = 128  # what a run's peak RSS takes above its budget and what it held before training


def shape(spec: str) -> dict:
    layers, d = (int(x) for x in spec.lower().split("x"))
    return dict(
        num_hidden_layers=layers,
        hidden_size=d,
        intermediate_size=256 * ((int(8 * d / 3) + 255) // 256),
        num_attention_heads=d // 128,
        num_key_value_heads=max(1, d // 512),
        vocab_size=32000,
        max_position_embeddings=512,
    )


def make_base(path: str, spec: str, family: str = "llama") -> dict:
    """A random model of ``family`` (llama, or qwen2: biased q/k/v) and ``spec`` saved with
    ``save_pretrained`` in bf16 (once per scratch)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        cfg = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family](**shape(spec), tie_word_embeddings=False)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(path, max_shard_size="2GB")
        del model
    files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")]
    return {"bytes_bf16": sum(os.path.getsize(f) for f in files)}


def tiertrain_worker(spec: dict) -> dict:
    from tiertrain.config import load_config
    from tiertrain.cost import measure_rates
    from tiertrain.cost.probe import DiskProbe
    from tiertrain.state.quant import base_storage
    from tiertrain.training.trainer import Trainer

    flags = [
        f"--model.hf_dir={spec['base']}",
        f"--io.paths={spec['scratch']}/ssd",
        f"--train.run_dir={spec['scratch']}/run",
        f"--data.seq_len={spec.get('seq', SEQ)}",
        f"--data.micro_batch_size={MBS}",
        f"--data.micro_batches={spec.get('micro_batches', M)}",
        "--data.tokenizer=bytes",
        f"--train.steps={spec['steps']}",
        "--train.progress=false",
        "--train.predict=false",
        "--train.overwrite=true",
        "--checkpoint.at_end=false",
        *([f"--memory.host_mib={spec['host_mib']}"] if spec.get("host_mib") else []),  # else: rss_mib's
        f"--train.device={spec.get('device', 'cpu')}",  # its compute dtype: fp32 on CPU, bf16 on CUDA
        "--adapter.kind=lora",
        "--adapter.rank=16",
        f"--adapter.target={','.join(TARGETS)}",
        *([f"--model.base_dtype={spec['base_dtype']}"] if spec["base_dtype"] else []),
        *([f"--model.base_double_quant={spec['double_quant']}"] if spec.get("double_quant") else []),
        *(f"--{kv}" for kv in spec.get("set", [])),
    ]
    from tiertrain.cost.budget import PoolsOverBudget

    cfg = load_config(None, flags)
    os.makedirs(f"{spec['scratch']}/ssd", exist_ok=True)
    with DiskProbe(cfg.io, spec.get("probe_mib", 1024)) as d:
        write = d.write()
        read = d.read()
    held = _rss_mib()  # before training: the interpreter and libraries, outside any budget
    if spec.get("rss_mib"):  # a peak RSS to aim at: the budget is what the process does not hold yet
        # less the allocator's slack above the budget (about 100 MiB on the 2.39 B Llama's runs)
        cfg.memory.host_mib = spec["host_mib"] = max(1, spec["rss_mib"] - held - RSS_SLACK_MIB)
    asked = spec["host_mib"]
    for attempt in range(4):
        try:
            tr = Trainer(cfg)
            break
        except PoolsOverBudget as exc:  # the fixed pools alone exceed it: the least budget that runs, said
            if attempt == 3:
                raise
            cfg.memory.host_mib = max(cfg.memory.host_mib + 64, -(-exc.needed // 2**20) + 32)
            print(f"budget refused ({exc}); running at {cfg.memory.host_mib} MiB", file=sys.stderr)
    with tr:
        tr.initialize(progress=False)
        recs = []
        for _ in range(spec["steps"]):
            recs.append(tr.train_step())
            print(recs[-1].line(spec["steps"]), file=sys.stderr, flush=True)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        walks = [io_walk(tr) for _ in range(2)]
        rates = measure_rates(tr.cfg, tr.rt, probe_mib=min(256, spec.get("probe_mib", 1024)))
        L = len(tr.model.blocks)
        compute = spec.get("micro_batches", M) * (
            rates.embed_fwd_s + L * (rates.block_fwd_s + rates.block_bwd_s) + rates.head_s
        )
        stored, sdt = base_storage(tr.cfg, tr.layout, tr.dtype, tr.rt.align)  # a 4-bit base: its bytes
        base_bytes = stored.total_numel * sdt.itemsize
        out = {
            "steps": [r.step_s for r in recs],
            "read": [r.ssd_read_bytes for r in recs],
            "write": [r.ssd_write_bytes for r in recs],
            "losses": [r.loss for r in recs],
            "peak": peak,
            "read_gbps": read,
            "write_gbps": write,
            "compute_s": compute,
            "walk_s": walks,
            "base_bytes": base_bytes,
            "params": tr.layout.n_params,
            "adapters": sum(p.numel() for p in tr.rt.adapters.params()),
            "base_dtype": tr.cfg.model.base_dtype or str(tr.rt.base_dtype).removeprefix("torch."),
            "held_mib": held,
            "budget": tr.budget.lines() if tr.budget else [],
            "asked_mib": asked,
            "host_mib": cfg.memory.host_mib,
        }
    return out


def _rss_mib() -> int:
    """The process's resident memory now, MiB (``VmRSS``)."""
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) // 1024 for x in f if x.startswith("VmRSS:"))


def io_walk(tr) -> float:
    """Seconds of one step's unit visits with no compute: every read, its checksum and the
    widen of a narrower base, through the same slots, prefetch and threads as the step (the
    data path's floor, measured minutes from the steps: the disk's rate drifts between probes)."""
    from tiertrain.execute.executor import visits
    from tiertrain.execute.walk import UnitWalk

    ex = tr.executor
    order = visits(ex.plan, ex.pieces_used, embed_backward=ex.embed_trains)
    t0 = time.perf_counter()
    walk = UnitWalk(tr.params, order)
    for ref in order:
        walk.enter(ref)
        walk.leave(ref)
    return time.perf_counter() - t0


def peft_worker(spec: dict) -> dict:
    """Plain PyTorch + peft with the whole model in memory: host memory in fp32 on CPU, device
    memory in bf16 on CUDA (tiertrain's compute dtype on each)."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from tiertrain.device import resolve_device, resolve_dtype

    dev = resolve_device(spec.get("device", "cpu"))
    dtype = resolve_dtype("auto", dev)  # tiertrain's compute dtype on this device
    model = AutoModelForCausalLM.from_pretrained(spec["base"], dtype=dtype).to(dev)
    model = peft.inject_adapter_in_model(peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS), model)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=3e-4, weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        m = spec.get("micro_batches", M)
        for _ in range(m):
            x = torch.randint(0, 256, (MBS, spec.get("seq", SEQ)), generator=g).to(dev)
            (model(input_ids=x, labels=x).loss / m).backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()  # sync point: the step's kernels in its time
        times.append(time.perf_counter() - t0)
    dev_peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
    return {"steps": times, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "dev_peak": dev_peak}


def spawn(kind: str, spec: dict) -> dict:
    """A worker in its own process: its peak RSS is its own."""
    r = subprocess.run([sys.executable, __file__, "--worker", kind, json.dumps(spec)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{kind} worker failed:\n{r.stderr[-4000:]}")
    sys.stderr.write(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def deepspeed_run(python: str, spec: dict, work: str) -> dict:
    """DeepSpeed ZeRO-3 (parameters on NVMe) + peft in its own process under ``python``: its
    steps, or ``error`` with the last line it printed."""
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, "spec.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_worker.py")
    r = subprocess.run([python, worker, "lora", work, path], capture_output=True, text=True)
    events = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    steps = [e for e in events if e.get("event") == "step"]
    if r.returncode != 0 or not steps:
        last = [x for x in r.stderr.strip().splitlines() if x.strip()][-1:] or [f"exit {r.returncode}"]
        return {"error": last[0][-400:], "ran_steps": len(steps)}
    ready = next(e for e in events if e.get("event") == "ready")
    return {
        "steps": [e["step_s"] for e in steps],
        "read": [e["read_bytes"] for e in steps],
        "peak": max(e["peak_rss"] for e in steps),
        "init_s": ready["init_s"],
        "losses": [e["loss"] for e in steps],
    }


def med(xs: list[float]) -> float:
    return statistics.median(xs[1:] or xs)  # the first step warms up


def where(args) -> tuple[str, str]:
    """Where the runs computed (the report's words) and the compute dtype's short name."""
    from tiertrain.bench.output import compute_line

    line = compute_line(getattr(args, "device", "cpu"))
    return line, "bf16" if line.startswith("bfloat16") else "fp32"


def machine() -> str:
    gib = 2**30
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / gib:.1f} GiB RAM, one virtual disk"
    )


def big_section(args, big: dict, base: dict) -> list[str]:
    """The big model's run: its steps against the I/O and compute floors."""
    gib = 2**30
    step = med(big["steps"])
    io = 2 * big["base_bytes"] / (big["read_gbps"] * 1e9)
    floor = max(io, big["compute_s"])
    fp32_states = 16 * big["params"]
    return [
        f"# LoRA on a frozen {big['params'] / 1e9:.2f} B-parameter Llama larger than memory",
        "",
        f"Machine: {machine()}. Model {args.big} (layers x width), vocabulary 32000, made with save_pretrained in bf16 "
        f"({base['bytes_bf16'] / 1e9:.2f} GB); full fp32 training with AdamW would need {fp32_states / 1e9:.0f} GB. "
        f"LoRA rank 16, alpha 32, on {', '.join(TARGETS)}: {big['adapters'] / 1e6:.1f} M trainable parameters. "
        f"{where(args)[0]}; the base kept in bf16 (model.base_dtype); {getattr(args, 'micro_batches', M)} micro-batches of {MBS} x {getattr(args, 'seq', SEQ)} tokens; "
        f"host budget {args.host_mib} MiB; {args.steps} steps, the first not counted.",
        "",
        *[f"    {x}" for x in big["budget"]],
        "",
        "| step | s | read GB | written GB | loss |",
        "|---|---|---|---|---|",
        *[
            f"| {i + 1} | {s:.1f} | {r / 1e9:.2f} | {w / 1e9:.2f} | {loss:.4f} |"
            for i, (s, r, w, loss) in enumerate(zip(big["steps"], big["read"], big["write"], big["losses"]))
        ],
        "",
        f"- peak RSS of the training process: **{big['peak'] / gib:.2f} GiB** (budget {big['host_mib'] / 1024:.2f} GiB"
        + (
            f"; {big['asked_mib']} MiB was refused: the fixed pools alone take more, so the least budget that runs"
            if big["host_mib"] != big["asked_mib"]
            else ""
        )
        + ")",
        f"- disk probed in the same process before training: read {big['read_gbps']:.2f} GB/s, write "
        f"{big['write_gbps']:.2f} GB/s",
        f"- I/O floor: two reads of the base, {2 * big['base_bytes'] / 1e9:.2f} GB at {big['read_gbps']:.2f} GB/s = "
        f"{io:.1f} s; compute floor (forward and backward of every unit in memory at this batch, measured): "
        f"{big['compute_s']:.1f} s",
        f"- the same step's unit visits with no compute (reads, checksums, widening; the same slots and "
        f"prefetch), right after the steps: {', '.join(f'{w:.1f}' for w in big['walk_s'])} s",
        f"- step (median of steps 2..): {step:.1f} s = **{step / io:.2f}x the I/O floor**, "
        f"{step / floor:.2f}x max(I/O, compute), {step / max(min(big['walk_s']), big['compute_s']):.2f}x "
        f"max(visits with no compute, compute); nothing written ({max(big['write']) / 1e9:.2f} GB a step at most)",
        "",
    ]


def report(args, big: dict | None, base: dict, peer: list, peer_tt: list, ds: dict | None = None) -> str:
    lines = big_section(args, big, base) if big else [
        "# LoRA against plain peft in memory", "", f"Machine: {machine()}.", ""
    ]  # fmt: skip
    if peer and peer_tt:
        lines += against_peft(args, peer, peer_tt)
    if big:
        lines += deepspeed_section(big, ds, where(args)[1])
    return "\n".join(lines)


def deepspeed_section(big: dict, ds: dict | None, dtype: str) -> list[str]:
    gib, step = 2**30, med(big["steps"])
    lines = [
        f"## DeepSpeed ZeRO-3, every parameter on NVMe, + peft (the big model, {dtype}, the same LoRA and batch)",
        "",
    ]
    if ds is None:
        lines.append("Not run: no interpreter with DeepSpeed given (--ds-python).")
    elif "error" in ds:
        lines.append(f"Did not run through ({ds['ran_steps']} steps): `{ds['error']}`")
    else:
        d = med(ds["steps"])
        lines += [
            "| system | s/step | peak RSS GiB | read GB/step |",
            "|---|---|---|---|",
            f"| DeepSpeed ZeRO-3 NVMe + peft | {d:.1f} | {ds['peak'] / gib:.2f} | {med(ds['read']) / 1e9:.1f} |",
            f"| tiertrain (above) | {step:.1f} | {big['peak'] / gib:.2f} | {med(big['read']) / 1e9:.1f} |",
            "",
            f"tiertrain: **{d / step:.2f}x faster than DeepSpeed at {big['peak'] / ds['peak']:.2f}x its peak RSS**; "
            f"DeepSpeed's start (its ops built or loaded, the base partitioned to NVMe) {ds['init_s']:.0f} s.",
        ]
    return lines


def against_peft(args, peers: list[dict], tts: list[dict]) -> list[str]:
    """The section against plain peft: each round's pair (alternated), then their medians."""
    gib, t0 = 2**30, tts[0]
    dev = f" (and {peers[0]['dev_peak'] / gib:.2f} GiB of device memory)" if peers[0].get("dev_peak") else ""
    rows, ratios = [], []
    for i, (p, t) in enumerate(zip(peers, tts)):
        ps, ts = med(p["steps"]), med(t["steps"])
        ratios.append((ts / ps, t["peak"] / p["peak"]))
        rows += [
            f"| {i + 1} | plain PyTorch + peft, in {'device ' if dev else ''}memory | {ps:.2f} | {p['peak'] / gib:.2f} |",
            f"| {i + 1} | tiertrain, budget {t['host_mib']} MiB (peak RSS aimed at {t['asked_rss_mib']} MiB, a fifth "
            f"of peft's, less {t['held_mib']} MiB held before training and {RSS_SLACK_MIB} MiB of slack"
            + (
                "; refused: the fixed pools alone take more, the least budget that runs"
                if t["host_mib"] != t["asked_mib"]
                else ""
            )
            + f") | {ts:.2f} | {t['peak'] / gib:.2f} |",
        ]
    step = statistics.median(r[0] for r in ratios)
    return [
        f"## Against plain peft in memory ({args.family} "
        f"{args.peer if args.peer != 'same' else args.big}, "
        f"{t0['params'] / 1e9:.2f} B parameters, {where(args)[1]}, the same LoRA and batch shape)",
        "",
        f"tiertrain's base on the tier in {t0['base_dtype']}"
        + (f" (set: {', '.join(f'`{kv}`' for kv in args.set)})" if args.set else "")
        + f"; peft's whole model in memory{dev}. "
        f"{len(peers)} round(s), the two alternated; each s/step the median of steps 2 on.",
        "",
        "| round | system | s/step | peak RSS GiB |",
        "|---|---|---|---|",
        *rows,
        "",
        f"tiertrain: **{step:.2f}x peft's step at {max(r[1] for r in ratios):.3f}x its peak RSS** "
        f"(median of the rounds' ratios: {', '.join(f'{r[0]:.2f}x' for r in ratios)}; the largest RSS ratio; "
        f"goal: within 1.2x at a fifth); it read {med(t0['read']) / 1e9:.2f} GB a step "
        f"(I/O floor {2 * t0['base_bytes'] / (t0['read_gbps'] * 1e9):.1f} s at {t0['read_gbps']:.2f} GB/s).",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--host-mib", type=int, default=2048)
    ap.add_argument("--big", default="33x2560", help="the big model: LAYERSxWIDTH (default: 2.46 B parameters)")
    ap.add_argument(
        "--peer", default="same", help="the model peft trains in memory (LAYERSxWIDTH; 'same': the big model, in fp32)"
    )
    ap.add_argument(
        "--family", default="llama", choices=("llama", "qwen2"), help="the models' family (qwen2: biased q/k/v)"
    )
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--skip-big", action="store_true", help="only the run against peft (its model: --peer)")
    ap.add_argument(
        "--peer-base-dtype", default="compute", choices=("compute", "bfloat16"),
        help="the base's dtype on the tier in the run against peft (compute: nothing to widen)",
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=1, help="peft and tiertrain alternated this many times")
    ap.add_argument("--seq", type=int, default=SEQ, help="tokens per micro-batch (one row each)")
    ap.add_argument("--micro-batches", type=int, default=M)
    ap.add_argument(
        "--ds-python", default=None, help="an interpreter with DeepSpeed: run ZeRO-3 + peft on the big model"
    )
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="train.device (bf16 compute on cuda)")
    ap.add_argument("--probe-mib", type=int, default=1024, help="MiB the disk probe writes and reads (floors)")
    ap.add_argument(
        "--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
        help="a setting for tiertrain's runs against peft (repeatable), e.g. memory.activations=offload",
    )  # fmt: skip
    ap.add_argument("--scratch", default=None, help=SCRATCH_HELP)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.skip_big and (args.skip_peer or args.ds_python):
        ap.error("--skip-big leaves only the run against peft: it takes neither --skip-peer nor --ds-python")
    if args.worker:
        kind, spec = args.worker[0], json.loads(args.worker[1])
        fn = {
            "tiertrain": tiertrain_worker,
            "peft": peft_worker,
            "base": lambda s: make_base(s["path"], s["shape"], s.get("family", "llama")),
        }
        print(json.dumps(fn[kind](spec)))
        return 0
    out = checked_out(args.out) if args.out else None
    with scratch_dir(args.scratch, "lora") as scratch:
        # the big model is made where it runs, or is peft's model
        needed = not args.skip_big or (args.peer == "same" and not args.skip_peer)
        base = (
            spawn("base", {"path": f"{scratch}/big-base", "shape": args.big, "family": args.family}) if needed else {}
        )
        big = None if args.skip_big else spawn(
            "tiertrain",
            dict(base=f"{scratch}/big-base", scratch=f"{scratch}/big", steps=args.steps, host_mib=args.host_mib,
                 base_dtype="bfloat16", seq=args.seq, micro_batches=args.micro_batches, device=args.device,
                 probe_mib=args.probe_mib),
        )  # fmt: skip
        peer, peer_tt = [], []
        if not args.skip_peer:
            pbase = f"{scratch}/big-base" if args.peer == "same" else f"{scratch}/peer-base"
            if args.peer != "same":
                spawn("base", {"path": pbase, "shape": args.peer, "family": args.family})
            for _ in range(args.rounds):
                peer.append(spawn("peft", dict(base=pbase, steps=args.steps, seq=args.seq,
                                               micro_batches=args.micro_batches, device=args.device)))  # fmt: skip
                rss = int(peer[-1]["peak"] / 5 / 2**20)  # a fifth of peft's peak RSS
                peer_tt.append(spawn(
                    "tiertrain",
                    dict(base=pbase, scratch=f"{scratch}/peer", steps=args.steps, rss_mib=rss,
                         base_dtype=None if args.peer_base_dtype == "compute" else args.peer_base_dtype,
                         seq=args.seq, micro_batches=args.micro_batches, device=args.device,
                         probe_mib=args.probe_mib, set=args.set),
                ))  # fmt: skip
                peer_tt[-1]["asked_rss_mib"] = rss
        ds = None
        if args.ds_python:
            ds = deepspeed_run(
                args.ds_python,
                dict(base=f"{scratch}/big-base", micro_batch_size=MBS, micro_batches=args.micro_batches, seq=args.seq, steps=args.steps,
                     rank=16, targets=TARGETS, device=args.device),
                f"{scratch}/deepspeed",
            )  # fmt: skip
    publish(report(args, big, base, peer, peer_tt, ds), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
