"""Batch inference over Ray Data: one mmkit engine per actor, from one laptop to a cluster.

    import ray
    from mmkit.ray import build_processor

    processor = build_processor(None, SamplingParams(temperature=0, max_tokens=32), concurrency=2)
    ds = ray.data.read_parquet("s3://bucket/vqa.parquet")        # columns: prompt|messages, image, ...
    processor(ds).write_parquet("s3://bucket/answers/")

Each replica is a Ray actor holding one `LLM`; Ray Data streams batches of rows to the
replicas with backpressure, so a dataset larger than memory flows through in bounded memory.
Images travel as what the row holds (encoded bytes, a path or a URL) and are decoded inside
the replica, never pickled as PIL images. The row format is described in `mmkit.ray.batch_rows`.
Needs the `ray` extra: `pip install -e ".[ray]"` from a clone.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import pyarrow as pa
import ray
import ray.data

from mmkit.ray.batch_rows import OUTPUT_COLUMNS, run_rows
from mmkit.sampling_params import SamplingParams

__all__ = ["build_processor", "Processor", "EngineReplica"]

_ARROW_TYPES = {"generated_text": pa.string(), "generated_tokens": pa.list_(pa.int64()),
                "finish_reason": pa.string(), "num_input_tokens": pa.int64(),
                "num_generated_tokens": pa.int64(), "error": pa.string()}
# Settings every replica needs before torch is imported (see docs/speed.md).
_WORKER_ENV_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000"}


class EngineReplica:
    """The actor behind `map_batches`: builds one `LLM` once, then generates batch after batch."""

    def __init__(self, model: str | None, sampling_params: SamplingParams | None, engine_args: dict[str, Any],
                 num_threads: int, max_in_flight: int | None, env: dict[str, str],
                 output_columns: tuple[str, ...] | None) -> None:
        # NOTE: set here, before this worker imports torch, rather than as a Ray runtime_env:
        # a runtime_env makes Ray start fresh worker processes for the replicas instead of
        # taking its pre-started idle ones (~0.5 s of every run on a small machine).
        os.environ.update(env)
        import torch

        torch.set_num_threads(num_threads)
        from mmkit.entrypoints.llm import LLM

        self.llm = LLM(model, **engine_args)
        self.sampling_params = sampling_params
        self.max_in_flight = max_in_flight
        self.output_columns = output_columns
        self.num_batches = 0

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        self.num_batches += 1
        outputs = run_rows(self.llm, rows, self.sampling_params, max_in_flight=self.max_in_flight,
                           request_prefix=f"batch{self.num_batches}")
        for name in OUTPUT_COLUMNS:
            if name in batch.column_names:
                batch = batch.drop_columns([name])
            batch = batch.append_column(name, pa.array([o[name] for o in outputs], type=_ARROW_TYPES[name]))
        if self.output_columns is not None:
            missing = [c for c in self.output_columns if c not in batch.column_names]
            if missing:
                raise ValueError(f"output_columns: {missing} are neither columns of the rows "
                                 f"{batch.column_names[:-len(OUTPUT_COLUMNS)]} nor generation columns "
                                 f"{list(OUTPUT_COLUMNS)}")
            batch = batch.select(list(self.output_columns))
        return batch


@dataclass(frozen=True)
class Processor:
    """`processor(ds) -> ds`: the rows of `ds` with the generation columns added.

    Lazy, as Ray Data is: nothing runs until the result is consumed (`take`, `iter_rows`,
    `write_parquet`, ...). Built by `build_processor`.
    """

    model: str | None
    sampling_params: SamplingParams | None
    concurrency: int
    batch_size: int
    num_gpus_per_replica: float
    num_cpus_per_replica: float
    max_in_flight: int | None
    engine_args: dict[str, Any] = field(default_factory=dict)
    output_columns: tuple[str, ...] | None = None
    preprocess: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    postprocess: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    def __call__(self, ds: ray.data.Dataset) -> ray.data.Dataset:
        if not isinstance(ds, ray.data.Dataset):
            raise TypeError(f"processor: got {type(ds).__name__}; expected a ray.data.Dataset")
        if self.preprocess is not None:
            ds = ds.map(self.preprocess)
        env = {k: os.environ.get(k, v) for k, v in _WORKER_ENV_DEFAULTS.items()}
        ds = ds.map_batches(
            EngineReplica,
            fn_constructor_kwargs={"model": self.model, "sampling_params": self.sampling_params,
                                   "engine_args": self.engine_args, "max_in_flight": self.max_in_flight,
                                   "num_threads": max(1, int(self.num_cpus_per_replica)), "env": env,
                                   "output_columns": self.output_columns},
            batch_format="pyarrow",
            batch_size=self.batch_size,
            compute=ray.data.ActorPoolStrategy(size=self.concurrency),
            num_cpus=self.num_cpus_per_replica,
            num_gpus=self.num_gpus_per_replica,
        )
        if self.postprocess is not None:
            ds = ds.map(self.postprocess)
        return ds


def sampling_params_from(value: SamplingParams | dict[str, Any] | None) -> SamplingParams | None:
    """`build_processor`'s `sampling_params`: a `SamplingParams`, a dict of its fields, or None."""
    if value is None or isinstance(value, SamplingParams):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"sampling_params: got {type(value).__name__}; expected SamplingParams, a dict of its "
                        "fields or None")
    known = set(inspect.signature(SamplingParams).parameters)
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        raise ValueError(f"sampling_params: unknown field(s) {unknown}; expected SamplingParams fields such as "
                         "temperature, top_p, max_tokens, stop, seed")
    try:
        return SamplingParams(**value)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"sampling_params: {exc}") from exc


def build_processor(model: str | None = None, sampling_params: SamplingParams | dict[str, Any] | None = None, *,
                    concurrency: int = 1, batch_size: int = 16, num_gpus_per_replica: float = 0,
                    num_cpus_per_replica: float | None = None, max_in_flight: int | None = None,
                    preprocess: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                    postprocess: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                    output_columns: Sequence[str] | None = None, **engine_args: Any) -> Processor:
    """A callable that runs `model` over a Ray Dataset with `concurrency` engine replicas.

    `model`: a checkpoint folder (on every node) or a cached model id; None: the embedded model.
    `sampling_params`: the default for every row (a row's `sampling_params` dict overrides fields):
    a `SamplingParams`, or a dict of its fields as `ray.data.llm` takes (checked here, so an
    unknown field fails at build time, named).
    `batch_size`: rows per batch handed to a replica (the replica batches them continuously).
    `num_gpus_per_replica` / `num_cpus_per_replica`: what each actor reserves (CPUs default to 1;
    on CPU the engine uses that many torch threads). `max_in_flight`: rows of a batch admitted
    to the engine at once (bounds decoded images; default the whole batch). `preprocess` /
    `postprocess`: per-row functions applied before / after generation, as in `ray.data.llm`.
    `output_columns`: keep only these columns (input or generation ones) in the result, selected
    inside the replica: large inputs such as image bytes are not shipped back, and no extra
    Ray Data stage runs.
    Every other keyword is an `EngineArgs` field (dtype, max_model_len, max_num_seqs, ...).
    """
    from mmkit.config import EngineArgs

    sampling_params = sampling_params_from(sampling_params)
    if model is not None and not isinstance(model, str):
        model = os.fspath(model)
    for name, value, lo in (("concurrency", concurrency, 1), ("batch_size", batch_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ValueError(f"{name}: got {value!r}; expected an integer >= {lo}")
    if max_in_flight is not None and (isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int)
                                      or max_in_flight < 1):
        raise ValueError(f"max_in_flight: got {max_in_flight!r}; expected None or an integer >= 1")
    if not isinstance(num_gpus_per_replica, (int, float)) or num_gpus_per_replica < 0:
        raise ValueError(f"num_gpus_per_replica: got {num_gpus_per_replica!r}; expected a number >= 0")
    if num_cpus_per_replica is None:
        num_cpus_per_replica = 1
    if not isinstance(num_cpus_per_replica, (int, float)) or num_cpus_per_replica <= 0:
        raise ValueError(f"num_cpus_per_replica: got {num_cpus_per_replica!r}; expected a number > 0")
    if output_columns is not None:
        if isinstance(output_columns, str) or not all(isinstance(c, str) for c in output_columns):
            raise TypeError(f"output_columns: got {output_columns!r}; expected a list of column names")
        output_columns = tuple(output_columns)
    EngineArgs(model=model, **engine_args)  # unknown or invalid engine arguments fail here, not in an actor
    return Processor(model, sampling_params, concurrency, batch_size, num_gpus_per_replica, num_cpus_per_replica,
                     max_in_flight, dict(engine_args), output_columns, preprocess, postprocess)
