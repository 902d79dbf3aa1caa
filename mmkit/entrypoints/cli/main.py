"""The `mmkit` command: caption images, ask a question, evaluate a dataset.

    mmkit caption IMAGE [IMAGE ...]
    mmkit ask IMAGE "QUESTION"
    mmkit eval DATA --output RESULTS.jsonl [--ray [--ray-address ADDR] [--concurrency N]]
    mmkit serve [--model M] [--port 8000]     (OpenAI-compatible server; needs the serve extra)
    mmkit serve ... --ray-serve --num-replicas N   (replicas on Ray Serve; needs the ray-serve extra)
"""

from __future__ import annotations

# NOTE: OpenMP's environment (OMP_WAIT_POLICY, GOMP_SPINCOUNT) is set by the package's
# __init__, which runs before this module and before torch loads.
import argparse
import contextlib
import importlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from mmkit.entrypoints.cli.parser import Parser
from mmkit.errors import RequestFailedError

CAPTION_QUESTION = "Describe the image."


def _common(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and sampling")
    g.add_argument("--model", default=None, help="checkpoint folder or cached model id (default: the embedded model)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--quantization", default=None, choices=["int8", "int4"],
                   help="online weight-only quantization of the decoder's linear layers (a compressed-tensors checkpoint is detected without it)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--model-impl", default="auto", choices=["auto", "mmkit", "transformers"],
                   help="which implementation runs the model: auto (native when mmkit has it, else the transformers backend), mmkit, or transformers (transformers' own modules on mmkit's engine)")
    _gpu_flags(g)
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens generated per answer (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy, reproducible (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the most likely tokens "
                                                            "whose probabilities add up to P (default 1: all)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--mm-processor-workers", type=int, default=0, metavar="N",
                   help="worker processes for the image processor's per-item work (default 0: two "
                        "threads of the engine's process; see docs/engine_args.md for sizing)")


def _gpu_flags(g) -> None:
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly, without CUDA graphs (no effect on CPU)")
    g.add_argument("--attention-backend", default="auto",
                   choices=["auto", "torch", "flex", "flashinfer", "flash_attn"],
                   help="kernels that read the paged KV cache (default auto: flex on CUDA, torch on CPU)")


def build_parser() -> argparse.ArgumentParser:
    from mmkit import __version__

    parser = Parser(prog="mmkit", description="Run vision-language models offline.")
    parser.add_argument("--version", action="version", version=f"mmkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("caption", help="print one caption per image",
                       description="Caption each image (one line per image).")
    p.add_argument("images", nargs="+", metavar="IMAGE")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar (shown for many images)")
    p.add_argument("--beam-width", type=int, default=1, metavar="N",
                   help="beam search with N beams (N > 1), printing the best beam (default 1: sampling as set)")
    _common(p)
    p = sub.add_parser("ask", help="answer a question about an image",
                       description="Answer QUESTION about IMAGE.")
    p.add_argument("image", metavar="IMAGE")
    p.add_argument("question", metavar="QUESTION")
    _common(p)
    p = sub.add_parser("eval", help="evaluate a JSONL/CSV dataset of image+question(+answer)",
                       description="Evaluate DATA (JSONL or CSV with columns image, question, optional "
                                   "answer, type and choices; image paths relative to DATA). An item with "
                                   "choices is answered with exactly one of them (structured outputs) and "
                                   "scored by exact match. Resumable.")
    p.add_argument("data", metavar="DATA")
    p.add_argument("--output", required=True, metavar="RESULTS.jsonl", help="one JSON line per item")
    p.add_argument("--summary", default=None, help="summary JSON (default: RESULTS.summary.json)")
    p.add_argument("--retry-errors", action="store_true", help="rerun items recorded with an error")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--max-in-flight", type=int, default=None, metavar="N",
                   help="items admitted to the engine at once (bounds memory; default 2 x max_num_seqs)")
    _ray_flags(p)
    _common(p)
    from mmkit.entrypoints.openai.cli_args import (
        add_serve_arguments,  # argparse only: stays light
    )

    p = sub.add_parser("serve", help="serve an OpenAI-compatible API (/v1/chat/completions, ...)",
                       description="Serve the model over HTTP with OpenAI's API; prints the URL when ready. "
                                   "Needs the serve extra (from a clone: pip install -e '.[serve]').")
    add_serve_arguments(p)
    return parser


def _ray_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Ray (from a clone: pip install -e '.[ray]')",
                                  "Run the items over Ray Data, one engine replica per actor; DATA may also be "
                                  "Parquet and any URI pyarrow reads (s3://, gs://, ...).")
    g.add_argument("--ray", action="store_true", help="run over Ray (a local Ray unless --ray-address)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="an existing cluster, e.g. 10.0.0.1:6379 (default: $RAY_ADDRESS, else start Ray here)")
    g.add_argument("--concurrency", type=int, default=1, metavar="N", help="engine replicas (default 1)")
    g.add_argument("--num-gpus-per-replica", type=float, default=0, metavar="G",
                   help="GPUs each replica reserves (1: one replica per GPU; default 0)")
    g.add_argument("--num-cpus-per-replica", type=float, default=None, metavar="C",
                   help="CPUs each replica reserves and its torch threads on CPU (default 1)")
    g.add_argument("--batch-size", type=int, default=16, metavar="B", help="rows per batch sent to a replica")


def _make_llm(args):
    # The wait users see first: say what loads, then how long it took (stderr: stdout is answers).
    print(f"mmkit {args.command}: loading {args.model or 'the embedded default model'} ...", file=sys.stderr,
          flush=True)
    start = time.perf_counter()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from mmkit import LLM

    llm = LLM(args.model, dtype=args.dtype, device=args.device, seed=args.seed, quantization=args.quantization,
              model_impl=args.model_impl, enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
              mm_processor_workers=args.mm_processor_workers)
    print(f"mmkit {args.command}: model loaded in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return llm


def _params(args):
    """The sampling values, checked (a `ValueError` naming the bad one). Called before the model
    loads, so a typo costs a fraction of a second, not a model load."""
    from mmkit import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                          seed=args.seed if args.temperature > 0 else None)


def _beam_params(args):
    """`--beam-width N`: beam search values, checked before the model loads (as `_params`)."""
    from mmkit import BeamSearchParams

    return BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens, temperature=args.temperature)


def question_inputs(llm, image, question: str) -> dict:
    """A user turn with the image then the question, rendered with the model's chat template."""
    from mmkit.entrypoints.chat_utils import conversations_to_inputs

    processor = llm.llm_engine.chat_processor()
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]
    return conversations_to_inputs(processor, messages)[0]


@contextlib.contextmanager
def _sigint_deferred():
    """SIGINT blocked for the block (POSIX); delivered, as KeyboardInterrupt, right after it."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def cmd_caption(args) -> int:
    from mmkit.entrypoints.cli.batch import generate_in_order
    from mmkit.multimodal.image_io import load_image

    params = _beam_params(args) if args.beam_width != 1 else _params(args)
    # An unreadable image is reported (path and reason) and skipped; the others are captioned.
    paths, images, failed = [], [], []
    for path in args.images:
        try:
            images.append(load_image(path, where=f"IMAGE {path}"))
            paths.append(path)
        except ValueError as exc:
            failed.append(path)
            print(f"mmkit caption: error: {exc}", file=sys.stderr, flush=True)
    if images:
        llm = _make_llm(args)
        inputs = [question_inputs(llm, img, CAPTION_QUESTION) for img in images]
        args.num_items, args.num_done = len(images), 0

        def show(i: int, out) -> None:
            text = out.outputs[0].text.strip()
            # A Ctrl-C waits until the caption is printed AND counted, so the "N of M" line
            # always names what was printed (it may land between any two bytecodes otherwise).
            with _sigint_deferred():
                print(text if len(args.images) == 1 else f"{paths[i]}\t{text}", flush=True)
                args.num_done += 1

        if args.beam_width != 1:  # every image's beams advance together: the best beams print at the end
            for i, out in enumerate(llm.beam_search(inputs, params, use_tqdm=len(images) > 1 and not args.no_progress)):
                text = out.sequences[0].text.strip()
                print(text if len(args.images) == 1 else f"{paths[i]}\t{text}", flush=True)
        else:  # captions print as they finish (in input order), so a Ctrl-C keeps what is done
            generate_in_order(llm, inputs, params, show, show_progress=len(images) > 1 and not args.no_progress)
    if failed:
        print(f"mmkit caption: {len(failed)} of {len(args.images)} images could not be read: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0


def cmd_ask(args) -> int:
    from mmkit.multimodal.image_io import load_image

    params = _params(args)
    image = load_image(args.image, where=f"IMAGE {args.image}")
    llm = _make_llm(args)
    out = llm.generate(question_inputs(llm, image, args.question), params, use_tqdm=False)
    print(out[0].outputs[0].text.strip())
    return 0


def cmd_eval(args) -> int:
    params = _params(args)
    if args.ray:
        return cmd_eval_ray(args, params)
    from mmkit.eval.evaluation import ResultsFile, read_dataset, run_evaluation
    from mmkit.multimodal.image_io import load_image

    items = read_dataset(args.data)
    results = ResultsFile(args.output)
    args.num_items = len(items)
    _say_resuming(args, results, items)
    llm = _make_llm(args)

    def build(item):
        image = load_image(item.image_path, where=f"item {item.index} ({item.image})")
        return question_inputs(llm, image, item.question)

    summary = run_evaluation(llm, items, results, build, params, retry_errors=args.retry_errors,
                             show_progress=not args.no_progress, max_in_flight=args.max_in_flight)
    return _write_summary(args, summary)


def _say_resuming(args, results, items) -> None:
    """`resuming: N of M already done` when the results file holds some of these items."""
    indices = {it.index for it in items}
    done = [r for i, r in results.records.items() if i in indices]
    if not done:
        return
    num_errors = sum(1 for r in done if r.get("error") is not None)
    num_done = len(done) - (num_errors if args.retry_errors else 0)
    line = f"mmkit eval: resuming: {num_done} of {len(items)} already done (in {args.output})"
    if args.retry_errors and num_errors:
        line += f"; retrying {num_errors} recorded with an error"
    print(line, file=sys.stderr, flush=True)


def _write_summary(args, summary) -> int:
    from mmkit.entrypoints.cli.batch import format_failures
    from mmkit.eval.evaluation import ResultsFile, format_summary, summary_path_for

    summary_path = Path(args.summary) if args.summary else summary_path_for(args.output)
    summary_path.write_text(json.dumps(summary.as_dict(), indent=2) + "\n")
    print(format_summary(summary))
    failures = format_failures(ResultsFile(args.output).records.values(), args.output)
    if failures:
        print(failures)
    print(f"results: {args.output}\nsummary: {summary_path}")
    return 0


def cmd_serve(args) -> int:
    from mmkit.entrypoints.openai.preflight import bind_listen_socket, check_serve_args

    # Before the model loads (and before torch is imported): seconds, not a minute, to learn
    # that the port is taken or a folder is missing.
    check_serve_args(args)
    ray_only = [flag for flag, given in (("--num-replicas", args.num_replicas != 1), ("--ray-address", args.ray_address),
                                         ("--num-gpus-per-replica", args.num_gpus_per_replica),
                                         ("--num-cpus-per-replica", args.num_cpus_per_replica is not None)) if given]
    if ray_only and not args.ray_serve:
        raise ValueError(f"{ray_only[0]}: only with --ray-serve (replicas on Ray Serve)")
    if args.ray_serve:
        return _serve_on_ray(args)
    args.listen_socket = bind_listen_socket(args.host, args.port)
    try:
        from mmkit.entrypoints.openai.api_server import run_server
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in ("fastapi", "uvicorn", "pydantic", "prometheus_client",
                                                   "starlette"):
            raise
        print(f"mmkit serve: error: {exc}; install the server's packages (from a clone): pip install -e '.[serve]'",
              file=sys.stderr)
        return 2
    return run_server(args)


def _serve_on_ray(args) -> int:
    try:
        from mmkit.ray.cluster import RayStartError
        from mmkit.ray.serve_cli import run_ray_serve
    except ImportError as exc:
        raise ValueError(f"--ray-serve: needs the ray-serve extra ({exc}); from a clone: pip install -e '.[ray-serve]'") from exc
    try:
        return run_ray_serve(args)
    except RayStartError as exc:  # one line, not Ray's traceback
        print(f"mmkit serve: error: {exc}", file=sys.stderr)
        return 1


def cmd_eval_ray(args, params) -> int:
    try:
        from mmkit.eval.ray_eval import EvalData, run_ray_evaluation
        from mmkit.ray.cluster import RayStartError, init_ray
    except ImportError as exc:
        raise ValueError(f"--ray: needs the ray extra ({exc}); from a clone: pip install -e '.[ray]'") from exc
    from mmkit.eval.evaluation import ResultsFile

    data = EvalData(args.data)
    results = ResultsFile(args.output)
    args.num_items = len(data.items)
    _say_resuming(args, results, data.items)
    cpus = args.num_cpus_per_replica or 1
    # NOTE: the driver needs torch only to validate the engine arguments; importing it on a
    # thread while Ray starts its own processes takes ~1.5 s off the run's critical path.
    warm = threading.Thread(target=importlib.import_module, args=("mmkit.config",), daemon=True)
    warm.start()
    # NOTE: replicas hold their CPUs for the whole run; one more logical CPU keeps Ray Data's
    # own small tasks schedulable on a machine whose cores the replicas take.
    try:
        init_ray(args.ray_address, num_cpus=max(os.cpu_count() or 1, int(args.concurrency * cpus + 0.999) + 1))
    except RayStartError as exc:  # one line, not Ray's traceback
        print(f"mmkit eval: error: {exc}", file=sys.stderr)
        return 1
    warm.join()
    try:
        summary = run_ray_evaluation(
            data, results, model=args.model, sampling_params=params,
            engine_args={"dtype": args.dtype, "device": args.device, "seed": args.seed,
                         "quantization": args.quantization, "model_impl": args.model_impl,
                         "enforce_eager": args.enforce_eager, "attention_backend": args.attention_backend,
                         "mm_processor_workers": args.mm_processor_workers},
            concurrency=args.concurrency, batch_size=args.batch_size,
            num_gpus_per_replica=args.num_gpus_per_replica, num_cpus_per_replica=args.num_cpus_per_replica,
            max_in_flight=args.max_in_flight, retry_errors=args.retry_errors, show_progress=not args.no_progress)
    finally:
        import ray

        ray.shutdown()
    return _write_summary(args, summary)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):
        # NOTE: bare `mmkit` is an incomplete command line, not a request for help: the usage and
        # the list of commands go to stderr with status 2, argparse's status for a usage error
        # (`mmkit --help` prints the same to stdout with status 0).
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
    handler = {"caption": cmd_caption, "ask": cmd_ask, "eval": cmd_eval, "serve": cmd_serve}[args.command]
    try:
        return handler(args)
    except (ValueError, TypeError) as exc:
        print(f"mmkit {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except RequestFailedError as exc:  # an item failed after it was admitted; the others printed
        print(f"mmkit {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        from mmkit.entrypoints.cli.batch import interrupted_message

        print(interrupted_message(args), file=sys.stderr, flush=True)
        return 130  # 128 + SIGINT, as a shell reports a Ctrl-C


if __name__ == "__main__":
    raise SystemExit(main())
