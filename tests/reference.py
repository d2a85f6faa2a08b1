"""Test helpers: small configs and flags; the plain PyTorch reference is ``tiertrain.reference``."""

from __future__ import annotations

from tiertrain.config import (
    Config,
    DataConfig,
    IOConfig,
    MemoryConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    UpdateConfig,
)
from tiertrain.cost.budget import STATES_ON_STORAGE
from tiertrain.reference import HFWrapper, reference_model, reference_train, weights_of  # noqa: F401 - re-exported


def small_config(
    tmp_path,
    *,
    kind="gpt",
    layers=3,
    d=64,
    heads=4,
    micro_batches=1,
    steps=4,
    clip=1.0,
    tie=False,
    dtype="float32",
    host_param_mib=0,
    grad_host_mib=0,
    stash_host_mib=0,
    paths=1,
    update_kib=64,
    slots=3,
    lr=2e-3,
    keep_act_mib=0,
    optim_host_mib=0,
    residual_host_mib=256,
    activations="keep",
    offload_pairs=None,
    dropout=0.0,
    **io,
) -> Config:
    """A tiny model whose every state is on the storage tier, with small update chunks so
    that chunks cut through parameters and units. Blocks are recomputed in the backward
    unless ``keep_act_mib`` is given (tests of kept graphs) or ``activations`` sends them to
    the storage tier (tests of offloaded ones)."""
    return Config(
        io=IOConfig(
            paths=[str(tmp_path / f"ssd{i}") for i in range(paths)],
            stripe_kib=64,
            chunk_kib=256,
            checksum_block_kib=64,
            **io,
        ),
        model=ModelConfig(
            kind=kind,
            n_layers=layers,
            d_model=d,
            n_heads=heads,
            vocab_size=256,
            max_seq_len=64,
            tie_embeddings=tie,
            dropout=dropout,
        ),
        data=DataConfig(seq_len=32, micro_batch_size=2, micro_batches=micro_batches),
        optim=OptimConfig(lr=lr, grad_clip=clip, warmup_steps=2, weight_decay=0.1),
        memory=MemoryConfig(
            device_slots=slots,
            host_param_mib=host_param_mib,
            grad_host_mib=grad_host_mib,
            stash_host_mib=stash_host_mib,
            update_buffer_kib=update_kib,
            keep_act_mib=keep_act_mib,
            optim_host_mib=optim_host_mib,
            residual_host_mib=residual_host_mib,
            activations=activations,
            offload_pairs=offload_pairs,
        ),
        update=UpdateConfig(mode="baseline"),  # the tests of the other paths set theirs; `auto` has its own
        train=TrainConfig(
            steps=steps, param_dtype=dtype, run_dir=str(tmp_path / "run"), progress=False, device="cpu", predict=False
        ),
    )


# the memory settings before the one budget: every state on the storage tier but for small
# host buffers of gradients, hidden states and residuals (the tests of the I/O paths need files)
ON_SSD = [f"--memory.{k}={v}" for k, v in STATES_ON_STORAGE.items()]


def llama_rank_flags(tmp_path, *extra: str) -> list[str]:
    """``tiertrain train`` flags of the small Llama the rank tests run (with or without
    ``--nproc``): scratch and run directory under ``tmp_path``, a checkpoint every step."""
    return [
        f"--io.paths={tmp_path / 'ssd'}",
        f"--train.run_dir={tmp_path / 'run'}",
        "--model.kind=llama",
        "--model.n_layers=2",
        "--model.d_model=64",
        "--data.seq_len=32",
        "--data.micro_batch_size=2",
        "--data.micro_batches=2",
        "--train.progress=false",
        "--io.checksum_block_kib=64",
        "--train.predict=false",
        "--checkpoint.every=1",
        *extra,
    ]


def tiny_flags(tmp_path, *extra: str, steps: int = 2, layers: int = 2) -> list[str]:
    """``tiertrain train`` flags of a run that takes about a second: scratch and run directory
    under ``tmp_path``, small chunks so that checksums and chunking are exercised."""
    return [
        f"--io.paths={tmp_path / 'ssd'}",
        f"--train.run_dir={tmp_path / 'run'}",
        f"--model.n_layers={layers}",
        "--model.d_model=64",
        "--data.seq_len=32",
        "--data.micro_batch_size=2",
        "--data.micro_batches=2",
        f"--train.steps={steps}",
        "--train.progress=false",
        "--io.chunk_kib=256",
        "--io.checksum_block_kib=64",
        "--io.stripe_kib=64",
        "--memory.update_buffer_kib=64",
        "--train.predict=false",
        *ON_SSD,
        *extra,
    ]


def assert_resume_exact(cfg_straight: Config, cfg_split: Config, steps: int = 4, split: int = 2) -> None:
    """``steps`` straight against ``split`` steps, a checkpoint, and the rest in a fresh
    trainer restored from it: the same losses and bit-identical weights."""
    import torch

    from tiertrain.training.trainer import Trainer

    for cfg in (cfg_straight, cfg_split):  # (a Trainer refuses a step past its schedule's)
        cfg.train.steps = max(cfg.train.steps, steps)
    with Trainer(cfg_straight) as tr:
        tr.initialize(progress=False)
        straight = [tr.train_step().extra["losses"] for _ in range(steps)]
        want = tr.weights()
    with Trainer(cfg_split) as tr:
        tr.initialize(progress=False)
        first = [tr.train_step().extra["losses"] for _ in range(split)]
        saved = tr.save_checkpoint()
    with Trainer(cfg_split) as tr:  # nothing carried over but the checkpoint
        tr.restore(saved.path)
        rest = [tr.train_step().extra["losses"] for _ in range(steps - split)]
        got = tr.weights()
    assert first + rest == straight
    assert all(torch.equal(got[k], want[k]) for k in want)
