"""Command line: ``python -m analysis {main-table,ablation,ruler,plot,frontier} [RUNS_DIR] [options]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from analysis.derived import parse_datasets
from analysis.load import NoResultsError

EXIT_USAGE = 2
EXIT_NO_RESULTS = 1


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

    parser = argparse.ArgumentParser(prog="python -m analysis", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def table_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--format", choices=["md", "latex", "csv"], default="md")
        p.add_argument("--out", metavar="FILE", help="write the table here instead of stdout")

    main = sub.add_parser("main-table", parents=[common], help="the main table (mean ± std)")
    table_options(main)
    main.add_argument("--ppl-datasets", default=None, metavar="A,B,C",
                      help="PPL datasets averaged (default: those every run with PPL reports, "
                           "e.g. wikitext2,ptb,c4 or ptb,wiki_proxy offline)")
    main.add_argument("--ppl-partial", action="store_true",
                      help="average the datasets a run has when some are missing (marked *)")

    abl = sub.add_parser("ablation", parents=[common], help="the ablation table")
    table_options(abl)
    abl.add_argument("--ppl-dataset", default=None, metavar="NAME",
                     help="PPL dataset of the PPL column (default: the first of wikitext2, ptb, "
                          "c4, then alphabetical, that every run with PPL reports)")
    abl.add_argument("--times", action="store_true",
                     help="add the allocation, calibration and layer-sensitivity wall times "
                          "(timings.*_s; e.g. experiment=cobra_plus_ablation)")

    ruler = sub.add_parser("ruler", parents=[source],
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

    front = sub.add_parser("frontier", parents=[common],
                           help="the rate-distortion frontier: eviction, codecs, compositions "
                                "against measured bpd_KV, the Pareto front (Markdown + PNG)")
    front.add_argument("--metric", action="append", default=None, metavar="METRIC",
                       help="a metric column (repeatable; default: ppl_mean and the "
                            "long-context metric the runs have)")
    front.add_argument("--out", metavar="FILE", help="write the Markdown here instead of stdout")
    front.add_argument("--figures", default="figures", metavar="DIR",
                       help="directory of the PNGs, one per model and metric (default: figures)")
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


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Execute the parsed command; return the exit code."""
    frame = load_frame(args, parser)
    if args.command == "main-table":
        from analysis.tables import main_table
        datasets = None if args.ppl_datasets is None else parse_datasets(args.ppl_datasets)
        if datasets == []:
            parser.error("--ppl-datasets is empty")
        write_table(main_table(frame, datasets, args.ppl_partial, args.longbench_metric,
                               args.experiment), args)
    elif args.command == "ablation":
        from analysis.tables import ablation_table
        write_table(ablation_table(frame, args.ppl_dataset, args.longbench_metric,
                                   args.experiment, times=args.times), args)
    elif args.command == "ruler":
        from analysis.ruler_table import ruler_table
        write_table(ruler_table(frame, args.experiment), args)
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
