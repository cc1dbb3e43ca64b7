"""The command line: `python -m loadtest --url URL --model NAME --scenario S [...]`."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import shlex
import sys
from pathlib import Path

import httpx

from loadtest import aio, scenarios
from loadtest.arguments import build_parser
from loadtest.client import ChatClient, make_transport, normalize_base_url
from loadtest.console import console_table
from loadtest.engine_probe import EngineProbe
from loadtest.loop_lag import Limits
from loadtest.overhead import fetch_engine_timings, overhead_summary
from loadtest.progress import Progress
from loadtest.report import Comparison, RunOutcome, write_outputs
from loadtest.runner import LoadShape, Runner, StopRule, Target
from loadtest.slo import SLOError, parse_slos, verdict

EXIT_OK, EXIT_SLO_MISSED, EXIT_USAGE, EXIT_NOTHING_COMPLETED = 0, 1, 2, 3

DEFAULT_REQUESTS = {"itinerary": 32, "random": 50}


def _shapes(args: argparse.Namespace) -> list[LoadShape]:
    if args.rate is None:
        return [LoadShape(concurrency=c) for c in (args.concurrency or [4])]
    if args.concurrency is not None and len(args.concurrency) > 1 and len(args.rate) > 1:
        raise ValueError("sweep either --concurrency or --rate, not both")
    ceilings = args.concurrency or [None]
    if len(ceilings) > 1:
        return [
            LoadShape(concurrency=c, rate=args.rate[0], arrival=args.arrival, burstiness=args.burstiness)
            for c in ceilings
        ]
    return [
        LoadShape(concurrency=ceilings[0], rate=r, arrival=args.arrival, burstiness=args.burstiness) for r in args.rate
    ]


def _sessions(args: argparse.Namespace):
    return scenarios.build(
        args.scenario,
        seed=args.seed,
        max_tokens=args.max_tokens,
        turns=args.turns,
        system_chars=args.system_chars,
        context_chars=args.context_chars,
        num_prompts=args.num_prompts,
        input_chars=args.input_chars,
        length_dist=args.length_dist,
        length_spread=args.length_spread,
        file=args.file,
    )


def _stop(args: argparse.Namespace) -> StopRule:
    count = args.num_requests
    if count is None and args.duration is None:
        if args.scenario == "articles":
            count = args.num_prompts
        elif args.scenario == "file":
            count = sum(len(s.turns) for s in _sessions(args))
        else:
            count = DEFAULT_REQUESTS[args.scenario]
    return StopRule(
        num_requests=count, duration_s=args.duration, warmup_requests=args.warmup[0], warmup_s=args.warmup[1]
    )


def _targets(args: argparse.Namespace) -> list[dict]:
    extra = dict(args.extra_body or {})
    if args.ignore_eos:
        extra["ignore_eos"] = True
    targets = [
        {
            "label": args.label_a,
            "url": args.url,
            "model": args.model,
            "headers": dict(args.header),
            "metrics_url": args.metrics_url,
            "extra": extra,
        }
    ]
    if args.compare:
        targets.append(
            {
                "label": args.label_b,
                "url": args.compare,
                "model": args.compare_model or args.model,
                "headers": {**dict(args.header), **dict(args.compare_header)},
                "metrics_url": args.compare_metrics_url,
                "extra": extra,
            }
        )
    return targets


async def run_all(
    args: argparse.Namespace, shapes: list[LoadShape], stop: StopRule, slos: dict[str, float], progress: Progress
) -> tuple[list, list]:
    """Every load level against every target: A then B per level, or both paired."""
    outcomes: list[RunOutcome] = []
    comparisons: list[Comparison] = []
    targets = _targets(args)
    groups = [targets] if args.compare_mode == "paired" and len(targets) == 2 else [[t] for t in targets]
    async with httpx.AsyncClient(trust_env=False) as probe_http:
        for shape in shapes:
            level: list[RunOutcome] = []
            for group in groups:
                results = await _run_group(args, group, shape, stop, progress, probe_http)
                for target, result in zip(group, results):
                    outcome = RunOutcome.of(
                        result,
                        normalize_base_url(target["url"]),
                        slos,
                        limits=Limits(p99_loop_lag_ms=args.loop_lag_limit),
                    )
                    if args.engine_timings_url and target is targets[0]:
                        timings = await fetch_engine_timings(args.engine_timings_url, probe_http)
                        outcome.summary.update(overhead_summary(result.measured, timings, origin=result.origin))
                    if slos:
                        outcome.verdict = verdict(outcome.summary, args.slo_attainment)
                    level.append(outcome)
            outcomes += level
            if len(level) == 2:
                comparisons.append(Comparison(shape.label, level[0], level[1], mode=args.compare_mode))
    return outcomes, comparisons


async def _run_group(
    args, group: list[dict], shape: LoadShape, stop: StopRule, progress: Progress, probe_http: httpx.AsyncClient
) -> list:
    """One run of one target, or of two paired targets; one RunResult per target."""
    pool = shape.concurrency if shape.concurrency else None
    async with contextlib.AsyncExitStack() as stack:
        runner_targets = []
        for target in group:
            http = await stack.enter_async_context(
                make_transport(args.http_client, max_connections=pool, timeout_s=args.timeout)
            )
            client = ChatClient(
                target["url"],
                http=http,
                model=target["model"],
                api_key=args.api_key,
                headers=target["headers"],
                timeout_s=args.timeout,
                extra_body=target["extra"],
                record_headers=tuple(args.record_header),
            )
            probe = (
                EngineProbe(target["metrics_url"], http=probe_http, interval_s=args.metrics_interval)
                if target["metrics_url"]
                else None
            )
            runner_targets.append(Target(target["label"], client, probe))
        first, *others = runner_targets
        runner = Runner(
            first.client,
            _sessions(args),
            shape,
            stop,
            target=first.label,
            run=shape.label,
            think_time_s=args.think_time,
            end_session_on_error=args.end_session_on_error,
            seed=args.seed,
            probe=first.probe,
            paired_with=others[0] if others else None,
            on_record=progress.update,
        )
        total = (stop.num_requests + stop.warmup_requests) * len(group) if (stop.num_requests is not None) else None
        progress.start(" + ".join(t.label for t in runner_targets) + f": {shape.label}", total)
        try:
            return await runner.run_all()
        finally:
            await progress.stop()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        slos = parse_slos(args.slo)
        shapes = _shapes(args)
        stop = _stop(args)
        next(iter(_sessions(args)), None)  # scenario errors now, not mid-run
    except (SLOError, ValueError, OSError) as exc:
        parser.error(str(exc))  # exits with EXIT_USAGE
    if not 0 < args.slo_attainment <= 1:
        parser.error("--slo-attainment must be in (0, 1]")
    if args.label_a == args.label_b:
        parser.error("--label-a and --label-b must differ")

    started = datetime.datetime.now(datetime.UTC)
    output = Path(args.output or f"loadtest/out/{args.scenario}-{started:%Y%m%d-%H%M%S}")
    config = {k: v for k, v in vars(args).items()}
    config.update(
        header=[list(h) for h in args.header],
        compare_header=[list(h) for h in args.compare_header],
        api_key="(set)" if args.api_key else None,
        command="python -m loadtest " + shlex.join(argv if argv is not None else sys.argv[1:]),
        started=started.isoformat(timespec="seconds"),
        stop=vars(stop).copy(),
    )
    progress = Progress(mode=args.progress)
    try:
        outcomes, comparisons = aio.run(run_all(args, shapes, stop, slos, progress), args.loop)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    document = write_outputs(output, outcomes, comparisons, config, plots=not args.no_plots)
    print(console_table(outcomes, comparisons))
    print(f"wrote {output}/report.md, summary.json, requests.jsonl")
    for outcome in outcomes:
        if outcome.verdict is not None and not outcome.verdict["passed"]:
            print(
                f"SLO missed: {outcome.result.target}: {outcome.result.run}: attainment "
                f"{outcome.verdict['slo_attainment']:.3f} < {args.slo_attainment:g}",
                file=sys.stderr,
            )
    if any(o.summary["completed"] == 0 for o in outcomes):
        print("a run completed no request at all", file=sys.stderr)
        return EXIT_NOTHING_COMPLETED
    return EXIT_OK if document["passed"] else EXIT_SLO_MISSED
