"""Command line: ``python -m analysis {main-table,ablation,ruler,plot,frontier} [RUNS_DIR] [options]``;
``python -m analysis plan EXPERIMENT_YAML DEVICE_DIR`` estimates a sweep's GPU-hours."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from analysis.derived import parse_datasets
from analysis.load import NoResultsError

EXIT_USAGE = 2
EXIT_NO_RESULTS = 1
EXIT_WANDB = 3


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with its sub-commands."""
    source = argparse.ArgumentParser(add_help=False)
    source.add_argument("runs_dir", nargs="?", metavar="RUNS_DIR",
                        help="directory searched recursively for result.json files")
    source.add_argument("--wandb", metavar="ENTITY/PROJECT",
                        help="read the runs from W&B (public API) instead of RUNS_DIR")
    source.add_argument("--experiment", metavar="NAME",
                        help="only runs with config.experiment=NAME")
    common = argparse.ArgumentParser(add_help=False, parents=[source])
    common.add_argument("--longbench-metric", default=None, metavar="COLUMN",
                        help="metric of the long-context column (default: the one the runs "
                             "have: longbench_avg, else longqa_squad_f1, the offline stand-in, "
                             "else RULER; e.g. longbench_qasper)")

    tracked = argparse.ArgumentParser(add_help=False)
    tracked.add_argument("--wandb-log", nargs="?", const="offline", default=None,
                         choices=["offline", "online"], metavar="MODE",
                         help="also log the table and figures as one W&B run in the sweep's group "
                              "(offline by default, into RUNS_DIR/wandb; online uploads)")
    tracked.add_argument("--wandb-group", metavar="NAME",
                         help="the W&B group of that run (default: RUNS_DIR's name, the group of "
                              "the sweep's jobs)")

    parser = argparse.ArgumentParser(prog="python -m analysis", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def table_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--format", choices=["md", "latex", "csv"], default="md")
        p.add_argument("--out", metavar="FILE", help="write the table here instead of stdout")

    main = sub.add_parser("main-table", parents=[common, tracked], help="the main table (mean ± std)")
    table_options(main)
    main.add_argument("--ppl-datasets", default=None, metavar="A,B,C",
                      help="PPL datasets averaged (default: those every run with PPL reports, "
                           "e.g. wikitext2,ptb,c4 or ptb,wiki_proxy offline)")
    main.add_argument("--ppl-partial", action="store_true",
                      help="average the datasets a run has when some are missing (marked *)")

    abl = sub.add_parser("ablation", parents=[common, tracked], help="the ablation table")
    table_options(abl)
    abl.add_argument("--ppl-dataset", default=None, metavar="NAME",
                     help="PPL dataset of the PPL column (default: the first of wikitext2, ptb, "
                          "c4, then alphabetical, that every run with PPL reports)")
    abl.add_argument("--times", action="store_true",
                     help="add the allocation, calibration and layer-sensitivity wall times "
                          "(timings.*_s; e.g. experiment=cobra_plus_ablation)")

    ruler = sub.add_parser("ruler", parents=[source, tracked],
                           help="RULER task by task: scores per task and length, protocol, "
                                "measured bpd_KV, wall time, prompt lengths")
    table_options(ruler)

    plot = sub.add_parser("plot", parents=[common], help="rate-distortion PNGs, one per model")
    plot.add_argument("--metric", default=None,
                      help="ppl_mean, ppl_gmean, ppl_ptb, zeroshot_avg, longbench_avg, "
                           "longqa_squad_f1, ... (any numeric metric column; default ppl_mean, "
                           "else zeroshot_avg, else the long-context metric)")
    plot.add_argument("--x", choices=["auto", "bpd_kv", "bpd_k"], default="auto",
                      help="x axis: measured bpd_K or bpd_KV = (K+V)/2 (default auto: bpd_K "
                           "when every compressed run keeps V at 16 bits, the K-track)")
    plot.add_argument("--out", default="figures", metavar="DIR", help="output directory")
    plot.add_argument("--ppl-datasets", default=None, metavar="A,B,C",
                      help="datasets of ppl_mean / ppl_gmean (default: those every run with "
                           "PPL reports)")
    plot.add_argument("--ppl-partial", action="store_true",
                      help="average the datasets a run has when some are missing")

    front = sub.add_parser("frontier", parents=[common, tracked],
                           help="the rate-distortion frontier: eviction, codecs, compositions "
                                "against measured bpd_KV, the Pareto front (Markdown + PNG)")
    front.add_argument("--metric", action="append", default=None, metavar="METRIC",
                       help="a metric column (repeatable; default: ppl_mean and the "
                            "long-context metric the runs have)")
    front.add_argument("--out", metavar="FILE", help="write the Markdown here instead of stdout")
    front.add_argument("--figures", default="figures", metavar="DIR",
                       help="directory of the PNGs, one per model and metric (default: figures)")

    plan = sub.add_parser("plan", help="a sweep's GPU-hours from measured device rates (an estimate, "
                                       "with its assumptions)")
    plan.add_argument("experiment", metavar="EXPERIMENT_YAML", help="e.g. conf/experiment/main_table.yaml")
    plan.add_argument("device_dir", metavar="DEVICE_DIR",
                      help="folder with anchor_batch.json and e2e32k.json (e.g. docs/performance/h200-2026-12-04)")
    plan.add_argument("--batch", type=int, default=32, help="batch size of every task (default 32)")
    plan.add_argument("--gpus", type=int, default=8, help="GPUs per node (default 8)")
    plan.add_argument("--out", metavar="FILE", help="write the Markdown here instead of stdout")
    return parser


def load_frame(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """The runs DataFrame from RUNS_DIR or --wandb (exactly one of them)."""
    if bool(args.runs_dir) == bool(args.wandb):
        parser.error("give either RUNS_DIR or --wandb ENTITY/PROJECT")
    if args.wandb:
        from analysis.wandb_source import load_wandb
        return load_wandb(args.wandb)
    from analysis.load import load_runs_dir
    return load_runs_dir(args.runs_dir)


def write_table(table, args: argparse.Namespace) -> None:
    """Print or write the rendered table; CSV notes go to stderr."""
    from analysis.render import render
    text = render(table, args.format)
    if args.format == "csv":
        for note in table.notes:
            print(f"note: {note}", file=sys.stderr)
    emit(text, args.out)


def emit(text: str, out: str | None) -> None:
    """Write ``text`` to the file ``out`` (saying so on stderr), or to stdout."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text, encoding="utf-8")
        print(f"wrote {out}", file=sys.stderr)
    else:
        sys.stdout.write(text)


def wandb_log(args: argparse.Namespace, frame, table=None, text: str | None = None,
              figures: list | None = None) -> int:
    """``--wandb-log``: the command's table, Markdown and figures into one W&B run (offline by
    default); a W&B failure is reported, the table is already written."""
    if not getattr(args, "wandb_log", None):
        return 0
    from analysis.render import render
    from analysis.wandb_log import log_analysis
    try:
        import tempfile
        with tempfile.TemporaryDirectory(prefix="kvbench-analysis-") as tmp:
            if figures is None:  # the tables' figure: metric against measured bpd, per model
                figures = rate_distortion_figures(frame, tmp)
            run_dir = log_analysis(args.command, args.runs_dir, frame, table=table,
                                   text=text if text is not None else render(table, "md"),
                                   figures=figures, mode=args.wandb_log, group=args.wandb_group)
    except Exception as exc:  # noqa: BLE001 - W&B's errors differ by version and transport
        print(f"error: --wandb-log: W&B logging failed: {exc}", file=sys.stderr)
        return EXIT_WANDB
    print(f"wrote W&B run {run_dir}", file=sys.stderr)
    return 0


def rate_distortion_figures(frame, out_dir: str) -> list:
    """The plot command's PNGs (its defaults) into ``out_dir``; none when nothing is drawable."""
    from analysis.plot import plot_rate_distortion
    try:
        return plot_rate_distortion(frame, None, out_dir)
    except (NoResultsError, ValueError) as exc:
        print(f"note: no rate-distortion figure for W&B: {exc}", file=sys.stderr)
        return []


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Execute the parsed command; return the exit code."""
    if args.command == "plan":
        from analysis.plan import plan
        emit(plan(Path(args.experiment), Path(args.device_dir), args.batch, args.gpus), args.out)
        return 0
    frame = load_frame(args, parser)
    if args.command == "main-table":
        from analysis.tables import main_table
        datasets = None if args.ppl_datasets is None else parse_datasets(args.ppl_datasets)
        if datasets == []:
            parser.error("--ppl-datasets is empty")
        table = main_table(frame, datasets, args.ppl_partial, args.longbench_metric, args.experiment)
        write_table(table, args)
        return wandb_log(args, frame, table)
    elif args.command == "ablation":
        from analysis.tables import ablation_table
        table = ablation_table(frame, args.ppl_dataset, args.longbench_metric, args.experiment,
                               times=args.times)
        write_table(table, args)
        return wandb_log(args, frame, table)
    elif args.command == "ruler":
        from analysis.ruler_table import ruler_table
        table = ruler_table(frame, args.experiment)
        write_table(table, args)
        return wandb_log(args, frame, table, figures=[])
    elif args.command == "frontier":
        from analysis.frontier import frontier_report
        if args.experiment:
            from analysis.select import experiment_of
            frame = frame[experiment_of(frame) == args.experiment]
        text, written = frontier_report(frame, args.metric, args.figures,
                                        Path(args.out).parent if args.out else None)
        for path in written:
            print(f"wrote {path}", file=sys.stderr)
        emit(text, args.out)
        return wandb_log(args, frame, text=text, figures=list(written))
    else:
        from analysis.plot import plot_rate_distortion
        if args.experiment:
            from analysis.select import experiment_of
            frame = frame[experiment_of(frame) == args.experiment]
        datasets = None if args.ppl_datasets is None else parse_datasets(args.ppl_datasets)
        for path in plot_rate_distortion(frame, args.metric, args.out, args.x, datasets,
                                         args.ppl_partial):
            print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run; errors become one ``error:`` line on stderr and an exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run(args, parser)
    except (FileNotFoundError, NotADirectoryError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except NoResultsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_NO_RESULTS
