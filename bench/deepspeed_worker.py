"""DeepSpeed ZeRO-Infinity side of bench/vs_deepspeed.py, run in its own process.

This file imports only torch, transformers, safetensors and deepspeed (never tiertrain), so
it can run under another interpreter that has DeepSpeed (``--ds-python``). It also holds
``ProcMeter``, the /proc reader both sides use so that disk bytes and peak RSS are measured
the same way for both systems.

    python bench/deepspeed_worker.py tune  WORK_DIR            -> prints the best aio settings (JSON)
    python bench/deepspeed_worker.py train WORK_DIR SPEC_JSON  -> prints one JSON line per step
    python bench/deepspeed_worker.py lora  WORK_DIR SPEC_JSON  -> LoRA (peft) on a frozen base, ZeRO-3
                                                                  with the parameters on NVMe (bench/lora.py)
"""

from __future__ import annotations

import json
import os
import sys
import time

AIO_SWEEP = dict(block_size=(256 << 10, 1 << 20, 4 << 20), queue_depth=(8, 32, 128), intra_op_parallelism=(1, 2))


class ProcMeter:
    """Disk bytes (``/proc/<pid>/io`` read_bytes/write_bytes: what reached the block layer)
    and peak RSS (VmHWM) of this process and every live descendant, summed.

    Summing each process's peak over-counts pages two processes share (shared-memory
    transfer slots), so for a multi-process system the figure is an upper bound."""

    def pids(self) -> list[int]:
        out, todo = [], [os.getpid()]
        while todo:
            pid = todo.pop()
            out.append(pid)
            try:
                for task in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{task}/children") as f:
                        todo += [int(c) for c in f.read().split()]
            except OSError:
                continue  # exited meanwhile
        return out

    def io(self) -> tuple[int, int]:
        read = written = 0
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/io") as f:
                    fields = dict(line.split(": ") for line in f.read().splitlines())
            except OSError:
                continue
            read += int(fields["read_bytes"])
            written += int(fields["write_bytes"]) - int(fields["cancelled_write_bytes"])
        return read, written

    def reset_peak(self) -> bool:
        ok = True
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                ok = False
        return ok

    def peak_rss(self) -> int:
        total = 0
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/status") as f:
                    total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
            except (OSError, StopIteration):
                continue
        return total


def _aio_op():
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().load()


def tune(work: str, size: int = 256 << 20) -> dict:
    """DeepSpeed's own aio handle, swept the way ds_nvme_tune does (block size x queue depth
    x parallelism, read and write of one file), best of three tries each."""
    import itertools

    import torch

    op = _aio_op()
    path = os.path.join(work, "aio-tune.bin")
    results = []
    for bs, qd, par in itertools.product(*AIO_SWEEP.values()):
        h = op.aio_handle(bs, qd, False, True, par)
        buf = h.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
        buf.random_(0, 255)
        best_w = best_r = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            h.sync_pwrite(buf, path)
            best_w = min(best_w, time.perf_counter() - t0)
            t0 = time.perf_counter()
            h.sync_pread(buf, path)
            best_r = min(best_r, time.perf_counter() - t0)
        h.free_cpu_locked_tensor(buf)
        results.append(
            dict(
                block_size=bs,
                queue_depth=qd,
                intra_op_parallelism=par,
                write_gbps=size / best_w / 1e9,
                read_gbps=size / best_r / 1e9,
                seconds=best_w + best_r,
            )
        )
    os.remove(path)
    best = min(results, key=lambda r: r["seconds"])
    return dict(best=best, sweep=results)


def zero3_params(nvme: str, largest: int) -> dict:
    """ZeRO-3 with every parameter on NVMe (``largest``: the largest parameter's elements)."""
    return {
        "stage": 3,
        # 0.19.8 asserts in its swap buffers when it prefetches on NVMe; 0 turns prefetch off
        "stage3_prefetch_bucket_size": 0,
        # keep no parameter past its use: with max_in_cpu 0 every live one holds a swap buffer
        "stage3_max_live_parameters": largest,
        "stage3_max_reuse_distance": 0,
        "offload_param": {
            "device": "nvme",
            "nvme_path": nvme,
            "pin_memory": True,
            "max_in_cpu": 0,
            "buffer_count": 5,
            "buffer_size": largest,
        },
    }


def ds_config(spec: dict, nvme: str, largest: int) -> dict:
    o = spec["optim"]
    return {
        "train_micro_batch_size_per_gpu": spec["micro_batch_size"],
        "gradient_accumulation_steps": spec["micro_batches"],
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": o["lr"],
                "betas": [o["beta1"], o["beta2"]],
                "eps": o["eps"],
                "weight_decay": o["weight_decay"],
            },
        },
        "gradient_clipping": o["grad_clip"],
        "bf16": {"enabled": spec.get("dtype") == "bfloat16"},  # fp32 master weights and moments, as tiertrain's
        "steps_per_print": 1 << 30,
        "zero_optimization": {
            **zero3_params(nvme, largest),
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": nvme,
                "pin_memory": True,
                "buffer_count": 4,
                "pipeline_read": True,
                "pipeline_write": True,
            },
        },
        "aio": {**{k: spec["aio"][k] for k in AIO_SWEEP}, "single_submit": False, "overlap_events": True},
    }


def train(work: str, spec: dict) -> None:
    """Train with ZeRO-3, parameters and optimizer on NVMe; one JSON line per step."""
    os.environ.update(MASTER_ADDR="localhost", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_PORT", str(spec.get("port", 29517)))
    import deepspeed
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    meter = ProcMeter()
    torch.manual_seed(0)
    cuda = spec.get("device") == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    hf = AutoConfig.from_pretrained(spec["init_dir"])
    h = hf.hidden_size
    largest = max(hf.vocab_size * h, hf.intermediate_size * h, h * h)
    nvme = os.path.join(work, "ds-nvme")
    os.makedirs(nvme, exist_ok=True)
    config = ds_config(spec, nvme, largest)
    t0 = time.perf_counter()
    # With this alive, from_pretrained builds the model inside zero.Init: each parameter is
    # partitioned to NVMe as it is created (in fp32; without a config, zero.Init picks bf16 on CPU).
    keep = HfDeepSpeedConfig(config)
    model = LlamaForCausalLM.from_pretrained(
        spec["init_dir"], dtype=torch.bfloat16 if spec.get("dtype") == "bfloat16" else torch.float32
    )
    model.config.use_cache = False
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.train()
    batches = load_file(spec["batches"])
    print(json.dumps(dict(event="ready", init_s=time.perf_counter() - t0, init_peak_rss=meter.peak_rss())), flush=True)

    def batch(step: int, m: int) -> dict:
        x, y = batches[f"x{step}_{m}"], batches[f"y{step}_{m}"]
        if cuda:
            x, y = x.cuda(), y.cuda()
        return dict(input_ids=x, labels=y, shift_labels=y)  # the same loss as tiertrain's head

    _steps(engine, meter, spec["steps"], spec["micro_batches"], batch)
    del keep  # zero.Init stays configured until the end


def _steps(engine, meter: ProcMeter, steps: int, micro_batches: int, batch) -> None:
    """``steps`` steps of ``micro_batches`` batches (``batch(step, m)``: the model's arguments),
    one JSON line each: seconds, mean loss, disk bytes, peak RSS."""
    meter.reset_peak()
    for step in range(steps):
        io0, s0, losses = meter.io(), time.perf_counter(), []
        for m in range(micro_batches):
            loss = engine(**batch(step, m)).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        io1 = meter.io()
        print(
            json.dumps(
                dict(
                    event="step",
                    step=step + 1,
                    step_s=time.perf_counter() - s0,
                    loss=sum(losses) / len(losses),
                    read_bytes=io1[0] - io0[0],
                    write_bytes=io1[1] - io0[1],
                    peak_rss=meter.peak_rss(),
                )
            ),
            flush=True,
        )


def lora(work: str, spec: dict) -> None:
    """peft's LoRA on the frozen base ``spec['base']`` under ZeRO-3 with every parameter on NVMe
    (the base built inside zero.Init from its safetensors, fp32 on CPU, bf16 on CUDA; the
    adapters' AdamW beside them: they are small), clipping at 1.0; random tokens as bench/lora.py's peft worker
    draws them. One JSON line per step, or the error where it does not run."""
    os.environ.update(MASTER_ADDR="localhost", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_PORT", str(spec.get("port", 29519)))
    import deepspeed
    import peft
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    meter = ProcMeter()
    cuda = spec.get("device") == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    hf = AutoConfig.from_pretrained(spec["base"])
    h = hf.hidden_size
    largest = max(hf.vocab_size * h, hf.intermediate_size * h, h * h)
    nvme = os.path.join(work, "ds-nvme")
    os.makedirs(nvme, exist_ok=True)
    M = spec["micro_batches"]
    config = {
        "train_micro_batch_size_per_gpu": spec["micro_batch_size"],
        "gradient_accumulation_steps": M,
        # torch's AdamW on CUDA too: DeepSpeed's fused one would be compiled on first use, minutes
        # of a GPU window for megabytes of adapters
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1, "torch_adam": cuda}},
        "gradient_clipping": 1.0,
        # on CUDA bf16 compute, as bench/lora.py's tiertrain and peft runs there (fp32 adapter masters)
        "bf16": {"enabled": cuda},
        "steps_per_print": 1 << 30,
        "zero_optimization": zero3_params(nvme, largest),
    }
    t0 = time.perf_counter()
    keep = HfDeepSpeedConfig(config)  # from_pretrained partitions each parameter to NVMe as it is made
    model = AutoModelForCausalLM.from_pretrained(spec["base"], dtype=torch.bfloat16 if cuda else torch.float32)
    model.config.use_cache = False
    lc = peft.LoraConfig(r=spec["rank"], lora_alpha=2 * spec["rank"], target_modules=spec["targets"])
    model = peft.get_peft_model(model, lc)
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trained, config=config)
    engine.train()
    print(json.dumps(dict(event="ready", init_s=time.perf_counter() - t0, init_peak_rss=meter.peak_rss())), flush=True)
    g = torch.Generator().manual_seed(0)

    def batch(step: int, m: int) -> dict:  # as bench/lora.py's peft worker draws them
        x = torch.randint(0, 256, (spec["micro_batch_size"], spec["seq"]), generator=g)
        x = x.cuda() if cuda else x
        return dict(input_ids=x, labels=x)

    _steps(engine, meter, spec["steps"], M, batch)
    del keep


def main(argv: list[str]) -> int:
    cmd, work = argv[0], argv[1]
    if cmd == "tune":
        print(json.dumps(tune(work)), flush=True)
    elif cmd in ("train", "lora"):
        with open(argv[2]) as f:
            (train if cmd == "train" else lora)(work, json.load(f))
    else:
        raise SystemExit(f"unknown command {cmd!r}: use 'tune', 'train' or 'lora'")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
