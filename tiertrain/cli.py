"""The ``tiertrain`` command."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import re
import signal
import sys
import threading
from typing import Iterator, Sequence

from .cli_parser import build_parser
from .config import ConfigError, config_reference, load_config, read_sections
from .errors import TiertrainError, UsageError, one_line
from .paths import missing_dirs

__all__ = ["main"]

log = logging.getLogger("tiertrain")


class _TqdmHandler(logging.StreamHandler):
    """Log lines written above a running progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def _setup_logging(verbose: bool = False) -> None:
    handler = _TqdmHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    log.handlers[:] = [handler]
    log.setLevel(logging.DEBUG if verbose else logging.INFO)
    log.propagate = False


def _cmd_bench_io(args: argparse.Namespace) -> int:
    from .bench.io import bench_io_command

    return bench_io_command(args)


def _launch(args: argparse.Namespace, overrides: Sequence[str], cfg) -> int:
    """``--nproc N``: this command again, as N ranks on this machine (``dist.launch``); its exit
    status is theirs. What it made for the ranks and they left empty (scratch parents, whose
    ``rank<r>`` subdirectories each rank removes; the run directory's ``ranks/``) is removed
    after them."""
    from .dist.launch import launch

    cmd = [
        *(["-v"] if args.verbose else []),
        "train",
        *(["--config", args.config] if args.config else []),
        *(["--resume", args.resume] if getattr(args, "resume", None) else []),
        *overrides,
    ]
    log.info("starting %d ranks: tiertrain %s", args.nproc, " ".join(cmd))
    ranks_dir = os.path.join(cfg.train.run_dir, "ranks")
    fresh = [d for p in (*cfg.io.paths, cfg.train.run_dir, ranks_dir) for d in missing_dirs(p)]
    try:
        return launch(cmd, args.nproc)
    finally:
        from .io.scratch import clean_abandoned  # what ranks ended or killed left: their states' size

        clean_abandoned(cfg.io.paths, "the ranks that did not finish")
        for p in reversed(fresh):  # the run directory's ranks/ before it, each before the parents made for it
            _remove_empty_tree(p)


def _remove_empty_tree(path: str) -> None:
    """``path`` and the directories under it, where they hold no file."""
    if not os.path.isdir(path):
        return
    for root, dirs, files in os.walk(path, topdown=False):
        if not files and not os.listdir(root):
            os.rmdir(root)


@contextlib.contextmanager
def _ranks(cfg) -> Iterator[object]:
    """The process group where torchrun started this process as one of several ranks (None
    otherwise). Ranks other than 0 log warnings and errors only: rank 0 prints the run."""
    from .dist import RankGroup, env_world
    from .dist.launch import end_with_launcher

    rank, world, _ = env_world()
    if world == 1:
        yield None
        return
    from .ranks_fit import refuse_nccl

    refuse_nccl(cfg.ranks.backend, world)
    end_with_launcher()
    if rank:
        log.setLevel(logging.WARNING)
    backend = cfg.ranks.backend if cfg.ranks.backend != "auto" else "gloo"
    from . import faults
    from .dist.launch import mark_joined
    from .training.interrupt import StopFlag

    faults.point("join")

    # from the group's forming on, a signal to this rank stops every rank at the first step boundary
    # (the run's own flag takes it over): raised here, it ended this rank alone, and the others
    # failed on it ("rank 1 died") or waited out the timeout
    with RankGroup(rank, world, backend=backend, timeout_s=cfg.ranks.timeout_s) as group, \
            StopFlag(announce=rank == 0, until="once the ranks have started"):  # fmt: skip
        mark_joined(rank)  # (for the launcher: from now on a signal is this flag's to take)
        yield group


def _cmd_train(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    nproc = getattr(args, "nproc", 1)
    if nproc < 1:
        raise UsageError(f"--nproc {nproc}: the number of ranks must be at least 1 (1: this process alone)")
    if getattr(args, "resume", None):
        path, cfg = _resume_target(args.resume, args.config, overrides)
    else:
        path, cfg = None, load_config(args.config, overrides)
    if nproc > 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # (a shell of Slurm's or torchrun's: --nproc ignored)
        raise UsageError(
            f"--nproc {nproc} with WORLD_SIZE={os.environ['WORLD_SIZE']} in the environment: this process is "
            "taken for one of the ranks another launcher started; unset WORLD_SIZE (and RANK) to start the ranks "
            "here, or drop --nproc under torchrun"
        )
    # this process (or the launcher of --nproc ranks, once for them all): a run directory holding a
    # run is refused before the plan's probes (seconds)
    if path is None and "WORLD_SIZE" not in os.environ:
        from .training.rundir import refuse_a_held_run

        run_dir, root = os.path.abspath(cfg.train.run_dir), os.path.abspath(cfg.checkpoint_root)
        refuse_a_held_run(run_dir, root, cfg.train.overwrite, probe=True)
    if nproc > 1:
        from .ranks_fit import check_ranks_fit, refuse_nccl

        refuse_nccl(cfg.ranks.backend, nproc)
        check_ranks_fit(nproc, cfg.memory.host_mib)
        return _launch(args, overrides, cfg)  # the config checked first: a bad one is reported once, not by every rank
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # before torch is imported: its C++ warnings (a TCPStore's stack trace once a peer's store is gone)
        # say nothing a rank's one-line error does not
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from .dist.group import RankError
    from .dist.launch import PEER_FAULT
    from .training.advice import resume_hint
    from .training.trainer import Trainer  # (not in the launcher: torch's import and exit cost it seconds)

    started = False  # the trainer built: with train.overwrite, the checkpoints there are this run's from then on
    try:
        with _ranks(cfg) as group, Trainer(cfg, group=group, resuming=path is not None) as trainer:
            started = True
            trainer.run(resume=path)
    except KeyboardInterrupt as exc:
        if str(exc) or not started:  # the first signal's stop said what follows; nothing ran yet
            raise
        # a second signal: stopped at once, mid-step (it printed a bare "interrupted")
        hint = resume_hint(exc, cfg, path).strip()
        raise KeyboardInterrupt(f"stopped at once{'; ' + hint[1:-1] if hint else ''}") from None
    except Exception as exc:
        from .io.scratch import DirInUseError

        if not _user_facing(exc):
            raise
        if isinstance(exc, ConfigError) and int(os.environ.get("RANK", "0")):  # every rank finds the config's fault:
            exc.quiet = True  # rank 0 says it (it was said once a rank)
        if isinstance(exc, (ConfigError, DirInUseError)):  # nothing ran: no checkpoint to point at
            raise
        from .data.examples import UnscoredStep

        # a fresh start over an earlier run that failed before it began: that run's checkpoints are not its own;
        # a step the data leaves unscored: a resume meets it again (the error says what to change)
        earlier = (path is None and cfg.train.overwrite and not started) or isinstance(exc, UnscoredStep)
        reported = _Reported(f"{one_line(exc)}{'' if earlier else resume_hint(exc, cfg, path)}")
        reported.quiet = getattr(exc, "quiet", False)
        if isinstance(exc, RankError):  # the ranks' fault, said (the rank that stopped named): the launcher
            # stops what is left at once
            reported.status = PEER_FAULT
        raise reported from None
    return 0


class _Reported(TiertrainError):
    """An error already phrased for the user; ``status``: the exit status it ends with."""

    status = 1


def _user_facing(exc: BaseException) -> bool:
    """Errors a user can act on (printed as one line); the rest are bugs (tracebacks)."""
    from .io.errors import StorageError

    return isinstance(exc, (TiertrainError, StorageError))


def _resume_target(where: str, config: str | None, overrides: Sequence[str], flag: str = "--resume"):
    """The checkpoint to resume (a checkpoint dir, a run dir, or 'latest') and the run's
    config: the checkpoint's own, with the given file and flags applied on top. ``flag``: the
    option the user gave it with (named in errors); ``--resume`` (training) also places the run
    where the checkpoint now is (``resumed_tree``), never where its stored paths point."""
    from .checkpoint import CheckpointError, Manifest
    from .config import Config, parse_overrides
    from .training.advice import find_resumable, intact_before
    from .training.rundir import resumed_tree

    if where == "latest":
        base = load_config(config, overrides)
        where = base.checkpoint_root
    path = find_resumable(where, flag)
    given: dict = {}
    if config is not None:  # only what the file sets overrides the checkpoint's config
        from .config import read_sections

        given = {s: dict(v) for s, v in read_sections(config).items()}
    for section, values in parse_overrides(overrides).items():
        given.setdefault(section, {}).update(values)
    try:
        stored = Manifest.read(path).config
    except CheckpointError as exc:  # (a damaged manifest: "use an earlier checkpoint", none named)
        if flag != "--resume":
            raise
        raise CheckpointError(f"{exc}{intact_before(path)}") from None
    if flag == "--checkpoint":
        from .inference.given import checked_given

        checked_given(given, stored)
    if flag == "--resume":
        return path, Config.from_dict(resumed_tree(stored, path, given, where))
    for section, values in given.items():
        stored.setdefault(section, {}).update(values)
    return path, Config.from_dict(stored)


def _cmd_plan(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    from .cost.probe import probe_fits
    from .paths import check_writable_dir
    from .runtime import Runtime

    if args.probe_mib < 1:
        raise ConfigError(f"--probe-mib = {args.probe_mib}: measure at least 1 MiB (default 256)")
    cfg = load_config(args.config, overrides).absolute()
    for p in cfg.io.paths:  # (a file there, or /proc: tracebacks, or "give a smaller --probe-mib")
        check_writable_dir("io.paths", p)
    probe_fits(args.probe_mib, cfg.io.paths, cfg.io.stripe_kib)
    fresh = [d for p in cfg.io.paths for d in missing_dirs(p)]  # the probe makes them: gone again after
    rt = Runtime(cfg)
    try:
        return _plan(args, cfg, rt)
    finally:
        rt.close()
        for p in reversed(fresh):  # each before the parents made for it
            _remove_empty_tree(p)


def _plan(args: argparse.Namespace, cfg, rt) -> int:
    """The run's plan (``training.plan``, as the trainer makes it) and its prediction, printed."""
    from .cost import estimate, measure_rates
    from .cost.report import plan_report
    from .training.plan import plan_run

    log.info(
        "probing this machine where a choice needs it: the storage tier (%d MiB written and read), CRC32C, "
        "one unit of each kind",
        args.probe_mib,
    )
    plan = plan_run(cfg, rt, probe_mib=args.probe_mib, measure=True)
    for line in plan.notes:
        log.info("%s", line)
    from .state.decl import SpacePlan  # (what train says at start: the plan said no space at all)

    log.info("scratch space needed on %s: %s", ", ".join(cfg.io.paths), SpacePlan(plan.states).describe())
    rates = plan.rates if plan.rates is not None else measure_rates(cfg, rt, probe_mib=args.probe_mib)
    if plan.budget.record_bytes:  # the dry run's figures, for the prediction of this plan
        rates = dataclasses.replace(rates, act_bytes=plan.budget.act_bytes, record_bytes=plan.budget.record_bytes)
    print(plan_report(plan.cfg, rt, plan.states, estimate(plan.cfg, rt, rates), plan.budget))
    return 0


def _data_given(config: str | None, overrides: Sequence[str], field: str) -> bool:
    """Whether ``data.<field>`` is set by a flag or the config file (else the command sets its own)."""
    in_file = (read_sections(config).get("data") or {}) if config else {}
    return field in in_file or any(o.startswith(f"--data.{field}") for o in overrides)


def _checkpoint_model(args: argparse.Namespace, overrides: Sequence[str]):
    """``--checkpoint``'s config (its own, the file and flags on top; its training text is not
    read) and its weights (``CheckpointWeights``, a context manager: checked, then read unit by
    unit)."""
    from .checkpoint import CheckpointError
    from .inference.weights import CheckpointWeights

    named = re.fullmatch(r"step-\d+", os.path.basename(os.path.normpath(args.checkpoint))) is not None
    attempts = 3
    while True:
        path = None
        try:
            path, cfg = _resume_target(
                args.checkpoint, args.config, [*overrides, "--data.corpus=bundled"], "--checkpoint"
            )
            return cfg, CheckpointWeights(path, hf_dir=cfg.model.hf_dir)
        except CheckpointError:
            # a run still training there pruned the newest checkpoint while it was opened (checkpoint.keep):
            # "is missing; use an earlier checkpoint", it said; the newest one again, where none was named
            gone = path is None or not os.path.exists(os.path.join(path, "manifest.json"))
            attempts -= 1
            if named or not gone or not attempts:
                raise
            log.info("--checkpoint %s: its newest checkpoint was removed while it was opened (a run saving there?); "
                     "taking the newest again", args.checkpoint)  # fmt: skip


def _cmd_eval(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    from .inference.evaluate import evaluate
    from .paths import first_json, prepare_output_file, to_stdout, write_output_file

    if not _data_given(args.config, overrides, "eval_micro_batches"):
        overrides = [*overrides, "--data.eval_micro_batches=0"]  # the whole text unless told otherwise

    def ours(path: str) -> bool:  # an earlier eval --out (a model's config.json, a corpus: never replaced)
        res = first_json(path)
        return isinstance(res, dict) and "loss" in res and "perplexity" in res

    out = prepare_output_file("eval --out", args.out, ours=ours) if args.out else None  # before the work
    if args.checkpoint:
        cfg, weights = _checkpoint_model(args, overrides)
        with weights:
            res = evaluate(cfg, weights=weights.source)
    else:
        cfg = load_config(args.config, overrides)
        _say_random(cfg, "eval")
        res = evaluate(cfg)
    to_stdout(res.line() + "\n", "eval")
    if out:  # (NaN and infinity as null: JSON has neither)
        fields = {
            k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in dataclasses.asdict(res).items()
        }
        ce = res.cross_entropy if math.isfinite(res.cross_entropy) else None
        write_output_file("eval --out", out, lambda f: json.dump({**fields, "cross_entropy": ce}, f))
    return 0


def _cmd_generate(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    from .inference.generate import Sampling
    from .inference.prompts import checked_out, read_prompts, run_generate

    texts = read_prompts(args.prompt, args.prompts_file)  # bad prompts fail before the model loads
    out = checked_out(args.out, args.prompts_file)  # and a bad --out
    stop = tuple(args.stop or ())
    sampling = Sampling(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature or 0.0,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=stop,
        stop_at_eos=not args.ignore_eos,
        repetition_penalty=args.repetition_penalty,
    )
    if args.checkpoint:
        cfg, weights = _checkpoint_model(args, [*overrides, "--data.eval_corpus=none", "--train.eval_every=0"])
        with weights:
            _say_greedy(cfg, args)
            run_generate(cfg, texts, sampling, out, weights=weights.source)
        return 0
    if not _data_given(args.config, overrides, "seq_len"):
        # generation reads no rows: the training default (128) refused models of a shorter context
        overrides = [*overrides, "--data.seq_len=1"]
    cfg = load_config(args.config, overrides)
    _say_random(cfg, "generate")
    _say_greedy(cfg, args)
    run_generate(cfg, texts, sampling, out)
    return 0


def _say_greedy(cfg, args: argparse.Namespace) -> None:
    """A model whose generation_config.json samples (transformers' generate does, by default)
    decoded greedily because no --temperature was given: said, with the flags of its sampling."""
    from .inference.generate import model_sampling

    own = model_sampling(cfg.model.hf_dir) if args.temperature is None else None
    if own:
        flags = " ".join(
            f"--{k.replace('_', '-')} {int(v) if k == 'top_k' else format(v, 'g')}" for k, v in own.items()
        )
        log.info(
            "generate: greedy (no --temperature given); the model's generation_config.json samples, as "
            "transformers' generate does with it: give %s to sample as it does",
            flags,
        )


def _say_random(cfg, command: str) -> None:
    """eval or generate with neither --checkpoint nor a model's weights: a random model's
    output, said (its only sign was a line "random init")."""
    m = cfg.model
    if m.init_from is None and (m.hf_dir is None or m.from_scratch):
        log.warning(
            "%s: no --checkpoint, model.hf_dir or model.init_from: the model's weights are random (seed %d), "
            "its output noise",
            command,
            cfg.train.seed,
        )


def _cmd_export(args: argparse.Namespace) -> int:
    from .checkpoint.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite, merge=args.merge, hf_dir=args.hf_dir)
    log.info("exported %s to %s", args.checkpoint, out)
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    from .data.formats import is_rows_input
    from .data.prepare import prepare, prepare_examples

    progress = not args.no_progress and sys.stderr.isatty()  # as training's bar: none in a log file
    rows = [is_rows_input(p) for p in args.input]
    if any(rows) and not all(rows):
        raise UsageError(
            "prepare: give either text files (.txt: a token file) or rows (.jsonl or .json, .parquet, a datasets "
            "directory: prepared examples), not both"
        )
    if all(rows):
        meta = prepare_examples(
            args.input,
            args.output,
            tokenizer=args.tokenizer,
            kind=args.format,
            mask_prompt=not args.no_mask_prompt,
            progress=progress,
        )
        log.info(
            "wrote %d %s example%s (%d tokens, %d of them scored) to %s",
            meta["examples"],
            meta["kind"],
            "" if meta["examples"] == 1 else "s",
            meta["tokens"],
            meta["scored"],
            args.output,
        )
        return 0
    n = prepare(args.input, args.output, tokenizer=args.tokenizer, progress=progress)
    log.info("wrote %d tokens to %s", n, args.output)
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from .plot import plot_runs

    out = args.out or os.path.join(args.run_dir[0], "curves.png")
    log.info("plotted %d run(s) into %s", len(args.run_dir), plot_runs(args.run_dir, out))
    return 0


def _cmd_config(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    if args.reference:
        print(config_reference())
        return 0
    cfg = load_config(args.config, overrides)
    for section, values in cfg.to_dict().items():
        print(f"[{section}]")
        for k, v in values.items():
            print(f"{k} = {_toml(v)}")
        print()
    return 0


def _toml(v: object) -> str:
    if v is None:
        return '"none"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):  # (TOML's basic strings are JSON's: quotes, backslashes, controls escaped)
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return repr(v)


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (schedulers, ``docker stop``) interrupts like Ctrl-C, so what a run made is
    cleaned up; once training runs, both stop it at a step boundary instead."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def main(argv: Sequence[str] | None = None) -> int:
    argv = _train_by_default(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser(__doc__)
    args, rest = parser.parse_known_args(argv)
    _setup_logging(args.verbose)
    from .paths import MADE_FOR_OUTPUT, remove_empty_dirs

    code = 1
    try:
        with _sigterm_interrupts():
            code = _run(parser, args, rest)
        return code
    finally:
        if code:  # an output's directories made for a command that failed: gone again (if left empty)
            remove_empty_dirs(MADE_FOR_OUTPUT)
        MADE_FOR_OUTPUT.clear()


def _train_by_default(argv: list[str]) -> list[str]:
    """Options given without a command are ``train``'s (no command runs the main job):
    ``tiertrain --resume DIR`` is ``tiertrain train --resume DIR``. argparse alone would take
    the option's value for a command and refuse it."""
    i = 0
    while i < len(argv) and argv[i] in ("-v", "--verbose"):
        i += 1
    if i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-h", "--help"):
        return [*argv[:i], "train", *argv[i:]]
    return argv


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, rest: list[str]) -> int:
    try:
        if args.cmd == "config":
            return _cmd_config(args, rest)
        if args.cmd == "plan":
            return _cmd_plan(args, rest)
        if args.cmd == "eval":
            return _cmd_eval(args, rest)
        if args.cmd == "generate":
            return _cmd_generate(args, rest)
        if args.cmd in (None, "train"):
            if args.cmd is None:
                args.config = None
            return _cmd_train(args, rest)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.cmd == "bench" and args.bench == "io":
            return _cmd_bench_io(args)
        if args.cmd == "prepare":
            return _cmd_prepare(args)
        if args.cmd == "plot":
            return _cmd_plot(args)
        if args.cmd == "export":
            return _cmd_export(args)
        parser.print_help()
        return 2
    except BrokenPipeError:  # `tiertrain generate ... | head`: the reader has what it wanted
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit's flush must not fail again)
        return 141  # as a shell's command killed by SIGPIPE
    except ConfigError as exc:
        if not exc.quiet:  # (with ranks: another rank of this machine says the same)
            _say(f"tiertrain: config error: {one_line(exc)}")
        return 2
    except Exception as exc:
        if not _user_facing(exc):
            raise
        if not getattr(exc, "quiet", False):  # another rank of this machine says the same
            hint = ""
            if isinstance(exc, OSError):  # a converted copy of weights: what to do with it
                from .inference.weights import copy_hint

                hint = copy_hint(exc.filename)
            _say(f"tiertrain: {one_line(exc)}" + (f"; {hint}" if hint else ""))
        log.debug("details", exc_info=True)
        return getattr(exc, "status", 1)
    except KeyboardInterrupt as exc:
        if os.environ.get("RANK", "0") == "0":  # with ranks, rank 0 speaks for them
            print(f"tiertrain: interrupted{f' ({exc})' if str(exc) else ''}", file=sys.stderr)
        return 130


def _say(line: str) -> None:
    """One line to stderr in one write: ranks share the terminal, and their lines must not run
    into each other."""
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (captured): one write to it
        sys.stderr.write(line + "\n")
        return
    os.write(fd, (line + "\n").encode(errors="replace"))


def console() -> None:
    """The ``tiertrain`` command (and ``python -m tiertrain``): ``main``, then exit without the
    interpreter's final collections over every object torch made (``gc.freeze``: about 1 s of
    every command's exit here; refcounting and atexit handlers still run)."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    console()
