"""`mmkit eval --ray`: the single-process evaluation's results and summary, over Ray Data replicas.

The driver reads the data's light columns (question, answer, type, image paths) to number the
items exactly as the single-process run does, drops the items already in the results file,
and hands the rest to `mmkit.ray.build_processor`; each answer is written to the results file
as it streams back, so a killed run resumes where it stopped. Images are loaded by the
replicas (paths and URLs) or carried as bytes (a Parquet binary column, or a `{bytes, path}`
struct as Hugging Face datasets write it).
"""

from __future__ import annotations

import io
import posixpath
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset
import pyarrow.fs

from mmkit.eval.evaluation import EvalItem, ResultsFile, Summary, items_from_rows, make_record, parse_rows, summarize

_LIGHT_COLUMNS = ("question", "answer", "type", "choices")
_CHUNK_ROWS = 256


def question_messages(question: str) -> list[dict[str, Any]]:
    """The user turn `mmkit eval` asks: the image, then the question (the image comes from the row)."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


class EvalData:
    """One data file (local path or any URI pyarrow reads): its items and the rows to run."""

    def __init__(self, data: str) -> None:
        self.data = data
        if "://" in data:
            self.fs, self.path = pyarrow.fs.FileSystem.from_uri(data)
        else:
            self.fs, self.path = pyarrow.fs.LocalFileSystem(), str(Path(data).resolve())
        info = self.fs.get_file_info(self.path)
        if info.type == pyarrow.fs.FileType.NotFound:
            raise ValueError(f"DATA: {data!r} does not exist")
        self.name = posixpath.basename(self.path.rstrip("/"))
        suffix = posixpath.splitext(self.name)[1].lower()
        self.is_parquet = suffix in (".parquet", ".pq") or info.type == pyarrow.fs.FileType.Directory
        self.binary_images = False
        self.items = self._read_items(suffix)

    def _read_items(self, suffix: str) -> list[EvalItem]:
        base = Path(posixpath.dirname(self.path))
        if not self.is_parquet:
            with self.fs.open_input_stream(self.path) as f:
                text = io.TextIOWrapper(io.BytesIO(f.read()), encoding="utf-8", newline="")
            return items_from_rows(parse_rows(text, self.name, is_csv=suffix == ".csv"), self.name, base)
        try:
            self.parquet = pyarrow.dataset.dataset(self.path, format="parquet", filesystem=self.fs)
            schema = self.parquet.schema
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(f"DATA: {self.name} cannot be read as Parquet ({exc})") from exc
        if "image" not in schema.names:
            raise ValueError(f"DATA: {self.name} has no 'image' column; expected columns image, question, "
                             "optional answer and type")
        image_type = schema.field("image").type
        self.binary_images = not (pa.types.is_string(image_type) or pa.types.is_large_string(image_type))
        columns = [c for c in _LIGHT_COLUMNS if c in schema.names] + ([] if self.binary_images else ["image"])
        rows = self.parquet.to_table(columns=columns).to_pylist()
        return items_from_rows(rows, self.name, base, image_column=None if self.binary_images else "image")

    def image_source(self, item: EvalItem) -> str:
        """An item's image path, made absolute (replicas may run in another folder or on another node)."""
        image = item.image
        if "://" in image[:32] or image.startswith(("data:", "/")):
            return image
        if isinstance(self.fs, pyarrow.fs.LocalFileSystem):
            return str(Path(posixpath.dirname(self.path)) / image)
        return self.data.rsplit("/", 1)[0] + "/" + image  # the same URI scheme as DATA

    def dataset(self, todo: list[EvalItem]):
        """A Ray Dataset of the items to run: index, messages and image (source or bytes)."""
        import ray
        import ray.data

        if not self.binary_images:
            return ray.data.from_items([{"index": it.index, "messages": question_messages(it.question),
                                         "image": self.image_source(it), "choices": it.choices} for it in todo])
        wanted = {it.index: it for it in todo}
        refs, start = [], 0
        # NOTE: the same pyarrow dataset, in the same order, as the light pass: row i is item i.
        for batch in self.parquet.to_batches(columns=["image"], batch_size=_CHUNK_ROWS, use_threads=False):
            images = batch.column(0)
            if pa.types.is_struct(images.type):  # Hugging Face datasets' Image feature: {bytes, path}
                images = images.field("bytes")
            keep = [i for i in range(len(images)) if start + i in wanted]
            if keep:
                refs.append(ray.put(pa.table({
                    "index": pa.array([start + i for i in keep], pa.int64()),
                    "messages": pa.array([question_messages(wanted[start + i].question) for i in keep]),
                    "image": images.take(pa.array(keep)).cast(pa.binary()),
                    "choices": pa.array([wanted[start + i].choices for i in keep], pa.list_(pa.string())),
                })))
            start += len(images)
        if not refs:
            return ray.data.from_items([])
        return ray.data.from_arrow_refs(refs)


def run_ray_evaluation(data: EvalData, results: ResultsFile, *, model: str | None, sampling_params,
                       engine_args: dict[str, Any], concurrency: int = 1, batch_size: int = 16,
                       num_gpus_per_replica: float = 0, num_cpus_per_replica: float | None = None,
                       max_in_flight: int | None = None, retry_errors: bool = False, show_progress: bool = True) -> Summary:
    """Run the unfinished items on the Ray cluster (already initialized); write each as it arrives."""
    import ray.data

    from mmkit.eval.progress import LineProgress, writes_lines
    from mmkit.ray import build_processor

    if retry_errors:
        results.drop({i for i, r in results.records.items() if r.get("error") is not None})
    todo = [it for it in data.items if it.index not in results.records]
    by_index = {it.index: it for it in todo}
    # NOTE: Ray Data's bars on a terminal; in a log (stderr not a terminal) one plain line now and then.
    bar = LineProgress(len(todo), "Evaluating", "item", file=sys.stderr) if show_progress and writes_lines() else None
    ray.data.DataContext.get_current().enable_progress_bars = show_progress and bar is None
    processor = build_processor(model, sampling_params, concurrency=concurrency, batch_size=batch_size,
                                num_gpus_per_replica=num_gpus_per_replica,
                                num_cpus_per_replica=num_cpus_per_replica, max_in_flight=max_in_flight,
                                output_columns=["index", "generated_text", "num_input_tokens",
                                                "num_generated_tokens", "error"], **engine_args)
    start = time.perf_counter()
    num_input = num_generated = num_done = 0
    try:
        if todo:
            for row in processor(data.dataset(todo)).iter_rows():
                item = by_index[row["index"]]
                if row["error"] is not None:
                    results.write(make_record(item, None, f"item {item.index} ({item.image}): {row['error']}"))
                else:
                    # A choices answer is one option verbatim (the replica dropped its leading space).
                    text = row["generated_text"]
                    results.write(make_record(item, text if item.choices else text.strip(), None))
                    num_input += row["num_input_tokens"]
                    num_generated += row["num_generated_tokens"]
                num_done += 1
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        results.close()
    seconds = time.perf_counter() - start
    rate = max(seconds, 1e-9)
    print(f"throughput: {num_done} items in {seconds:.1f} s: {num_done / rate:.2f} items/s, "
          f"{num_generated / rate:.1f} output tokens/s, {num_input / rate:.1f} input tokens/s", flush=True)
    return summarize(results.records.values(), seconds)
