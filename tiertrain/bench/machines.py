"""Predictions for machines we do not have: the same cost model (bytes per step per link over
bandwidths, compute over FLOP/s, the schedule's overlap), from stated inputs instead of
probes, for a Llama shape given by its sizes (no weights are built).

Every figure here is PREDICTED, never measured; the inputs are listed with it. Bytes per
parameter per step with bf16 parameters, fp32 master weights and moments, every state on the
NVMe drives (docs/DESIGN.md): tiertrain (layer-major) reads the parameters twice (2 + 2 B),
writes and reads the gradients (2 + 2 B), reads and writes master and moments (12 + 12 B) and
writes the parameters (2 B); ZeRO-Infinity's schedule reads the parameters in the forward
and the backward of every micro-batch (4 B x M), moves gradients to the host per micro-batch
(2 B x M down, kept in host memory in fp32) and runs the same 12 + 12 B update after the
backward, with AdamW on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Machine", "LlamaShape", "Predicted", "predict_on", "MACHINES", "SHAPES"]


@dataclass(frozen=True)
class Machine:
    name: str
    gpu_tflops: float  # dense bf16 peak
    mfu: float  # fraction of peak one unit's compute reaches (stated)
    pcie_gbps: float  # per direction, pinned
    drives: int
    drive_read_gbps: float
    drive_write_gbps: float
    cpu_cores: int
    adam_gelem_per_core: float  # CPU AdamW, G elements/s per core


@dataclass(frozen=True)
class LlamaShape:
    name: str
    layers: int
    d: int
    ff: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def block_params(self) -> int:
        kv = self.d * self.d * self.kv_heads // self.heads
        return 2 * self.d * self.d + 2 * kv + 3 * self.d * self.ff + 2 * self.d

    @property
    def params(self) -> int:
        return self.layers * self.block_params + 2 * self.vocab * self.d + self.d


# Stated inputs (sources: vendor datasheets; the MFU a unit reaches is an assumption)
MACHINES = {
    f"H100 SXM, {n} NVMe": Machine(
        f"H100 SXM, {n} NVMe",
        gpu_tflops=989.0,
        mfu=0.5,
        pcie_gbps=50.0,
        drives=n,
        drive_read_gbps=7.0,
        drive_write_gbps=5.0,
        cpu_cores=32,
        adam_gelem_per_core=1.0,
    )
    for n in (1, 2, 4)
}
SHAPES = {
    "Llama 7B": LlamaShape("Llama 7B", layers=32, d=4096, ff=11008, heads=32, kv_heads=32, vocab=32000),
    "Llama 70B": LlamaShape("Llama 70B", layers=80, d=8192, ff=28672, heads=64, kv_heads=8, vocab=128256),
}


@dataclass
class Predicted:
    system: str
    step_s: float
    mfu: float
    bound: str
    compute_s: float
    nvme_s: float
    pcie_s: float
    update_s: float


def predict_on(
    shape: LlamaShape,
    m: Machine,
    *,
    seq: int = 4096,
    micro_batch: int = 1,
    micro_batches: int = 8,
    system: str = "baseline",
) -> Predicted:
    """One step of ``shape`` on ``m``: ``system`` is 'baseline', 'overlap' or 'engines'
    (tiertrain's update paths) or 'zero-infinity' (DeepSpeed's schedule, same bytes per
    micro-batch). The forward is a third of the compute, the backward two thirds."""
    n, M = shape.params, micro_batches
    tokens = seq * micro_batch * M
    flops = 6 * n * tokens + 12 * shape.layers * shape.d * seq * seq * micro_batch * M  # + attention (PaLM)
    compute = flops / (m.gpu_tflops * 1e12 * m.mfu)
    rd, wr = m.drives * m.drive_read_gbps * 1e9, m.drives * m.drive_write_gbps * 1e9
    adam = n / (m.cpu_cores * m.adam_gelem_per_core * 1e9)
    if system == "zero-infinity":
        nvme_fb = 4 * n * M / rd  # parameters per micro-batch, forward and backward
        pcie = (4 * n * M + 2 * n * M) / (m.pcie_gbps * 1e9)
        train = max(compute, nvme_fb, pcie)
        upd = max(12 * n / rd + 12 * n / wr + 2 * n / wr, adam)  # after the backward, not overlapped
        step = train + upd
        bound = (
            "update"
            if upd > train
            else ("NVMe" if nvme_fb >= max(compute, pcie) else "PCIe" if pcie >= compute else "compute")
        )
        return Predicted(
            system, step, 6 * n * tokens / step / (m.gpu_tflops * 1e12), bound, compute, nvme_fb, pcie, upd
        )
    nvme_fb = 4 * n / rd + 2 * n / wr  # parameters twice, gradients out
    pcie = (4 * n + 2 * n) / (m.pcie_gbps * 1e9)
    upd_io = (2 + 12) * n / rd + (12 + 2) * n / wr  # gradients and states in, states and parameters out
    upd = max(upd_io, adam)
    train = max(compute, nvme_fb, pcie)
    if system == "engines":  # under the next forward and backward, on the same drives
        step = max(train, nvme_fb + upd_io, adam)
        bound = "NVMe (whole step)" if step == nvme_fb + upd_io else ("CPU AdamW" if step == adam else "compute")
    elif system == "overlap":  # under the next forward only (clipping needs the whole backward first)
        fwd = max(compute / 3, 2 * n / rd + upd_io, adam, 2 * n / (m.pcie_gbps * 1e9))
        bwd = max(2 * compute / 3, 2 * n / rd + 2 * n / wr, 4 * n / (m.pcie_gbps * 1e9))
        step = fwd + bwd
        bound = "update under the forward" if fwd > compute / 3 else "compute"
    else:
        step = train + upd
        bound = "update" if upd > train else ("compute" if compute >= max(nvme_fb, pcie) else "NVMe/PCIe")
    return Predicted(system, step, 6 * n * tokens / step / (m.gpu_tflops * 1e12), bound, compute, nvme_fb, pcie, upd)


def table(seq: int = 4096, micro_batches: tuple[int, ...] = (8, 64)) -> str:
    """PREDICTED step time and MFU, tiertrain's three update paths next to ZeRO-Infinity's
    schedule, for every shape, machine and number of micro-batches (of ``seq`` tokens)."""
    rows = [
        "| model | machine | M (tokens/step) | tiertrain baseline s (MFU) | tiertrain overlap s (MFU) |"
        " tiertrain engines s (MFU) | ZeRO-Infinity schedule s (MFU) | engines bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for shape in SHAPES.values():
        for m in MACHINES.values():
            for M in micro_batches:
                p = {
                    s: predict_on(shape, m, seq=seq, micro_batches=M, system=s)
                    for s in ("baseline", "overlap", "engines", "zero-infinity")
                }
                cell = lambda q: f"{q.step_s:.1f} ({100 * q.mfu:.0f}%)"  # noqa: E731
                rows.append(
                    f"| {shape.name} ({shape.params / 1e9:.1f} B) | {m.name} | {M} ({M * seq:,}) |"
                    f" {cell(p['baseline'])} | {cell(p['overlap'])} | {cell(p['engines'])} |"
                    f" {cell(p['zero-infinity'])} |"
                    f" {p['engines'].bound} |"
                )
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
