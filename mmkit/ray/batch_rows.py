"""Dataset rows -> engine requests -> output columns, one bad row never failing the others.

The row format is the one `ray.data.llm` users know; `mmkit.ray` runs it inside each replica,
but nothing here imports Ray (nor does `mmkit/ray/__init__.py` until a Ray name is used), so it runs (and is tested) in a plain process too.

Input row: `prompt` (str, with the model's image placeholder once per image) or `messages`
(an OpenAI-style conversation, rendered with the checkpoint's chat template), optional `image`
(encoded bytes, a path, a URL or a list of them), optional `sampling_params` (a dict of
`SamplingParams` fields; null fields are ignored) and optional `choices` (structured outputs).
Output columns: `generated_text`, `generated_tokens`, `finish_reason`, `num_input_tokens`,
`num_generated_tokens`, and `error` (None, or why this row failed: bad image, bad prompt, ...).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, TypedDict

from mmkit.errors import error_message
from mmkit.sampling_params import SamplingParams

#: The columns every processed row gains (an input column with the same name is replaced).
OUTPUT_COLUMNS = ("generated_text", "generated_tokens", "finish_reason", "num_input_tokens",
                  "num_generated_tokens", "error")
_USER_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name != "eos_token_ids")
# Schemes load_image handles itself; any other `scheme://` goes through pyarrow's filesystems.
_LOCAL_SCHEMES = ("http://", "https://", "file:", "data:")


class RowOutput(TypedDict):
    generated_text: str | None
    generated_tokens: list[int] | None
    finish_reason: str | None
    num_input_tokens: int | None
    num_generated_tokens: int | None
    error: str | None


def error_output(message: str) -> RowOutput:
    return RowOutput(generated_text=None, generated_tokens=None, finish_reason=None, num_input_tokens=None,
                     num_generated_tokens=None, error=message)


def choices_params(params: SamplingParams, choices: list[str], where: str) -> SamplingParams:
    """`params` constrained to answer exactly one of `choices` (structured outputs), after one
    optional space that `_ok_output` drops (chat models answer " red", not "red"); the grammar
    bounds the length, so `max_tokens` is lifted. The same constraint as `mmkit eval`'s choices.

    NOTE: the one place that knows how structured outputs are spelled.
    """
    try:
        from mmkit.eval.evaluation import choice_params
    except ImportError as exc:  # pragma: no cover - a build without structured outputs
        raise ValueError(f"{where}choices: this build of mmkit has no structured outputs ({exc})") from exc
    return choice_params(params, choices)


def row_params(where: str, row: dict[str, Any], default: SamplingParams | None) -> SamplingParams:
    """The row's SamplingParams: the processor's default with the row's own fields on top."""
    params = default or SamplingParams()
    given = row.get("sampling_params")
    if given is not None:
        if not isinstance(given, dict):
            raise TypeError(f"{where}sampling_params: got {type(given).__name__}; expected a dict of "
                            "SamplingParams fields")
        fields = {k: v for k, v in given.items() if v is not None}  # Arrow structs fill missing keys with null
        unknown = sorted(set(fields) - set(_USER_FIELDS))
        if unknown:
            raise ValueError(f"{where}sampling_params: unknown field(s) {unknown}; expected SamplingParams "
                             f"fields {list(_USER_FIELDS)}")
        try:
            params = params.clone(**{k: _plain(v) for k, v in fields.items()})
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{where}sampling_params.{exc}") from exc
    choices = row.get("choices")
    if choices is not None:
        choices = _plain(choices)
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"{where}choices: got {choices!r:.80}; expected a non-empty list of non-empty strings")
        params = choices_params(params, choices, where)
    return params


def row_inputs(where: str, row: dict[str, Any], processor) -> dict[str, Any]:
    """The row's `generate` input: its prompt (or rendered messages) with its decoded images."""
    from mmkit.entrypoints.chat_utils import conversations_to_inputs

    images = [load_row_image(f"{where}image[{i}]", src) for i, src in enumerate(_image_sources(row.get("image")))]
    prompt, messages = row.get("prompt"), row.get("messages")
    if (prompt is None) == (messages is None):
        raise ValueError(f"{where or 'row'}: got {'both' if prompt is not None else 'neither'} of 'prompt' and "
                         "'messages'; expected exactly one")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise TypeError(f"{where}prompt: got {type(prompt).__name__}; expected str")
        if not prompt.strip():
            raise ValueError(f"{where}prompt: got {prompt!r}; expected non-empty text")
        item: dict[str, Any] = {"prompt": prompt}
        if images:
            item["multi_modal_data"] = {"image": images}
        return item
    conversation = _fill_image_parts(where, _plain(messages), images)
    return conversations_to_inputs(processor, conversation)[0]


def _fill_image_parts(where: str, messages: Any, images: list) -> list[dict[str, Any]]:
    """Give each `{"type": "image"}` part without a payload the next image of the `image` column;
    with no such part at all, the images go first in the first user message (LLaVA's habit)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}messages: got {messages!r:.80}; expected a non-empty list of messages")
    pending = list(images)
    out, num_slots = [], 0
    for m, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}messages[{m}]: got {message!r:.80}; expected a dict with 'role' and 'content'")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for p, part in enumerate(content):
                if isinstance(part, dict):
                    part = {k: v for k, v in part.items() if v is not None}  # Arrow's filled-in nulls
                    if part.get("type") == "image" and part.get("image") is None:
                        num_slots += 1
                        if not pending:
                            raise ValueError(f"{where}messages[{m}].content[{p}]: an image part without an image, "
                                             f"and the row's image column has only {len(images)}; expected one "
                                             "image per empty image part")
                        part["image"] = pending.pop(0)
                    elif part.get("type") == "image" and not _is_pil(part["image"]):
                        part["image"] = load_row_image(f"{where}messages[{m}].content[{p}].image", part["image"])
                parts.append(part)
            message = dict(message, content=parts)
        out.append(message)
    if pending and num_slots:
        raise ValueError(f"{where or 'row'}: the messages have {num_slots} empty image part(s) but the image column has "
                         f"{len(images)} image(s); expected one image per empty image part")
    if pending:
        first_user = next((i for i, msg in enumerate(out) if msg.get("role") == "user"), None)
        if first_user is None:
            raise ValueError(f"{where or 'row'}: the row has images but its messages have no user turn to put them in")
        content = out[first_user]["content"]
        text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
        out[first_user] = dict(out[first_user], content=[{"type": "image", "image": im} for im in pending] + text)
    return out


def _image_sources(value: Any) -> list[Any]:
    value = _plain(value)
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def load_row_image(where: str, source: Any):
    """Decode one image inside the replica: bytes, a path, an http(s)/file/data URL, or any
    `scheme://` URI pyarrow can read (s3://, gs://, hdfs://, ...)."""
    from mmkit.multimodal.image_io import load_image, load_image_bytes

    if isinstance(source, str) and "://" in source[:32] and not source.lower().startswith(_LOCAL_SCHEMES):
        import pyarrow.fs

        try:
            fs, path = pyarrow.fs.FileSystem.from_uri(source)
            with fs.open_input_stream(path) as f:
                data = f.read()
        except Exception as exc:  # noqa: BLE001 - pyarrow raises OSError, ArrowInvalid, ...
            raise ValueError(f"{where}: {source!r} cannot be read ({exc}); expected a readable image URI") from exc
        return load_image_bytes(data, where=where, name=f"URI '{source}'")
    return load_image(source, where=where)


def run_rows(llm, rows: list[dict[str, Any]], default_params: SamplingParams | None = None, *,
             max_in_flight: int | None = None, request_prefix: str = "row") -> list[RowOutput]:
    """Generate for every row with one engine; a bad row gets `error`, the others go on.

    Rows are admitted `max_in_flight` at a time (default: all), so at most that many rows'
    images are decoded at once; the engine batches the admitted rows continuously.
    """
    from mmkit.engine.request_driver import ErrorPolicy, RequestDriver, drive
    from mmkit.multimodal.parse import parse_prompt

    engine = llm.llm_engine
    processor = engine.chat_processor()
    results: list[RowOutput | None] = [None] * len(rows)
    index: dict[str, int] = {}

    def prepare(i: int):
        rid, where = f"{request_prefix}-{i}", ""  # errors name the row's fields: "image[0]: ..."
        params = row_params(where, rows[i], default_params)
        parsed = parse_prompt(i, row_inputs(where, rows[i], processor))
        return engine.process_request(rid, parsed, params)

    def admissions():
        for i in range(len(rows)):
            rid = f"{request_prefix}-{i}"
            index[rid] = i
            yield rid, functools.partial(prepare, i)

    def on_error(rid: str, exc: BaseException) -> None:  # a bad row, or the engine error of a row in flight
        results[index[rid]] = error_output(error_message(exc))

    def on_output(out) -> None:
        i = index[out.request_id]
        results[i] = _ok_output(out, has_choices=rows[i].get("choices") is not None)

    drive(RequestDriver(engine), admissions(), policy=ErrorPolicy.PER_ITEM, window=max_in_flight or max(len(rows), 1),
          on_output=on_output, on_error=on_error)
    assert all(r is not None for r in results), "every row gets an output or an error"
    return results  # type: ignore[return-value]


def _ok_output(out, has_choices: bool = False) -> RowOutput:
    completion = out.outputs[0]
    text = completion.text.removeprefix(" ") if has_choices else completion.text
    return RowOutput(generated_text=text, generated_tokens=list(completion.token_ids),
                     finish_reason=completion.finish_reason, num_input_tokens=len(out.prompt_token_ids),
                     num_generated_tokens=len(completion.token_ids), error=None)


def _plain(value: Any) -> Any:
    """numpy arrays and scalars (how some Ray batch formats hand back lists) -> Python values."""
    tolist: Callable[[], Any] | None = getattr(value, "tolist", None)
    if tolist is not None and not isinstance(value, (str, bytes)):
        return _plain(tolist())
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _is_pil(value: Any) -> bool:
    from PIL import Image

    return isinstance(value, Image.Image)
