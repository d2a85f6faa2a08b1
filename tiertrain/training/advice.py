"""What to run next, after a run stopped on an error: the command that continues it from its
newest (intact) checkpoint, or, where it wrote none, how to start it over. Said once, by the
command line, after the error's own line: the parts that raise the error do not know which
checkpoints exist (an engine's "resume from the last checkpoint" was printed where none did)."""

from __future__ import annotations

import os

from .rundir import METRICS, missing_checkpoint_dir, no_checkpoint_advice, stored_checkpoint_root

__all__ = ["resume_hint", "find_resumable", "restorable", "nothing_to_train", "intact_before"]


def resume_hint(exc: BaseException, cfg, resumed: str | None) -> str:
    """`` (...)`` to append to ``exc``'s line: resume from the newest checkpoint, or, where the
    checkpoint ``resumed`` from is the damaged one (``exc`` raised while restoring it: its
    ``restoring``), from the newest intact one before it, beside it; where
    the run wrote steps but no checkpoint, start over."""
    from ..checkpoint import CheckpointError, CheckpointMismatch, intact_checkpoint, latest_checkpoint, step_of
    from ..dist import env_world
    from ..dist.launch import resume_command

    if isinstance(exc, CheckpointMismatch):  # intact: its own config is the remedy, said in the error
        return ""
    world = env_world()[1]
    root = os.path.abspath(cfg.checkpoint_root)
    run_dir = os.path.abspath(cfg.train.run_dir)
    if resumed is not None and isinstance(exc, CheckpointError) and getattr(exc, "restoring", False):
        # (an error of a later save, say out of space, is no fault of the checkpoint resumed from)
        named = _named_step(resumed)
        where = os.path.dirname(os.path.abspath(resumed)) if named else root  # (another run's directory, maybe)
        good = intact_checkpoint(where, before=step_of(resumed) if named else None, skip=resumed)
        if good is None:
            return " (no intact checkpoint is left before it: start over with --train.overwrite=true)"
        return f" (the newest intact checkpoint before it is {good}: `{resume_command(run_dir, world, good)}`)"
    last = latest_checkpoint(root)
    if last:
        return f" (the last checkpoint is {last}: `{resume_command(run_dir, world)}`)"
    if not _holds_steps(run_dir):
        return ""
    # (the default saves at the end only: say how the next run keeps what a crash would lose)
    every = (
        "" if cfg.checkpoint.every else "; it saves only at its end (checkpoint.every = 0): give --checkpoint.every=N"
    )
    return f" ({no_checkpoint_advice(run_dir)}{every and every + ' to keep the steps a crash would lose'})"


def intact_before(damaged: str) -> str:
    """`` (...)`` naming the newest intact checkpoint beside ``damaged`` (one whose manifest
    cannot be read: its run's config with it) and the command that resumes it."""
    from ..checkpoint import intact_checkpoint, step_of

    named = _named_step(damaged)
    where = os.path.dirname(os.path.abspath(damaged))
    good = intact_checkpoint(where, before=step_of(damaged) if named else None, skip=damaged)
    if good is None:
        return " (no intact checkpoint is left before it)"
    return f" (the newest intact checkpoint before it is {good}: `tiertrain train --resume {good}`)"


def restorable(path: str) -> str:
    """``Trainer.restore``'s checkpoint: a run directory's latest (as ``train(resume=)`` takes
    one: it failed with "no manifest.json"); any other path as given (its own errors)."""
    from ..checkpoint.manifest import MANIFEST

    if os.path.exists(os.path.join(path, MANIFEST)) or not os.path.isdir(path):
        return path
    inside = os.listdir(path)  # a run directory (its checkpoints here or in its checkpoint.dir), or checkpoints/
    if "checkpoints" in inside or "config.json" in inside or any(n.startswith("step-") for n in inside):
        return find_resumable(path, "Trainer.restore()")
    return path


def find_resumable(where: str, flag: str = "--resume") -> str:
    """``find_checkpoint``; where ``where`` (a run directory, or its checkpoints directory) holds
    a run that wrote no checkpoint, the refusal says there is nothing to resume and how to start
    over (it said "no complete checkpoint", and a fresh start into it said "use --resume")."""
    from ..checkpoint import CheckpointError, find_checkpoint

    try:
        return find_checkpoint(where, flag)
    except CheckpointError:
        elsewhere = stored_checkpoint_root(where)  # the run's checkpoint.dir, outside the run directory
        if elsewhere is not None:
            missing = missing_checkpoint_dir(where)
            if missing:  # (it named a path never typed: "--resume CKDIR: no such directory")
                raise CheckpointError(f"{flag} {where}: {missing}") from None
            return find_checkpoint(elsewhere, flag)
        run_dir = where if _holds_steps(where) else os.path.dirname(os.path.normpath(os.path.abspath(where)))
        if not _holds_steps(run_dir):
            raise
        if flag != "--resume":  # (eval, generate: told to start the run over, without --resume)
            raise CheckpointError(
                f"{flag} {where}: no checkpoint there: the run in {run_dir} stopped before its first checkpoint; "
                "give a checkpoint (a run directory that holds one), or a model directory with --model.hf_dir"
            ) from None
        raise CheckpointError(f"{flag} {where}: no checkpoint there; {no_checkpoint_advice(run_dir)}") from None


def _holds_steps(run_dir: str) -> bool:
    return os.path.exists(os.path.join(run_dir, METRICS))


def _named_step(path: str) -> bool:
    from ..checkpoint import step_of

    try:
        step_of(path)
        return True
    except ValueError:
        return False


def nothing_to_train(step: int, steps: int, resume: str) -> str:
    """Said where a resumed run is already at ``train.steps`` (``resume``: its resume command)."""
    return (
        f"the run is already at step {step} of train.steps = {steps}: nothing to train; to train further, "
        f"raise it: {resume} --train.steps={steps + step}"
    )
