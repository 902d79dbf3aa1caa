"""What `mmkit serve` checks before it loads the model (seconds, not the model's load time).

Loading a model can take a minute; a port already in use, a media folder that does not
exist or a chat-template file that is not there should fail before that, with the flag and
the value in the message. Only the standard library here: the command runs these checks
before it imports torch or fastapi.
"""

from __future__ import annotations

import errno
import socket
from pathlib import Path
from typing import Any


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """Bind `host:port` now (as uvicorn would: SO_REUSEADDR, IPv6 when the host has a ':'),
    so a taken port is an error before the model loads. The bound socket is handed to uvicorn,
    so nothing can take the port in between. Raises `ValueError` naming the port."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port: got {port}; expected 0-65535 (0 picks a free port)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except socket.gaierror as exc:
        sock.close()
        raise ValueError(f"--host: cannot listen on {host!r} ({exc.strerror}); expected an address of "
                         "this machine such as 127.0.0.1 or 0.0.0.0") from exc
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"--port: port {port} on {host} is already in use (another server?); stop it or "
                             f"pass another --port (--port 0 picks a free one)") from exc
        if exc.errno == errno.EACCES:
            raise ValueError(f"--port: not allowed to listen on port {port} (ports below 1024 need root); "
                             "pass --port 1024 or higher") from exc
        raise ValueError(f"--host/--port: cannot listen on {host}:{port} ({exc.strerror})") from exc
    sock.set_inheritable(True)
    return sock


def check_serve_args(args: Any) -> None:
    """The flags that name files and folders: each must exist, checked before the model loads."""
    if args.allowed_local_media_path:
        media = Path(args.allowed_local_media_path).expanduser()
        if not media.is_dir():
            raise ValueError(f"--allowed-local-media-path: {str(media)!r} is not a folder"
                             + (" (it does not exist)" if not media.exists() else ""))
    template = args.chat_template
    if template is not None and "{" not in template and not Path(template).expanduser().is_file():
        raise ValueError(f"--chat-template: {template!r} is neither a file nor a Jinja template")
    gen = args.generation_config
    if gen not in ("auto", "vllm") and not (Path(gen) / "generation_config.json").is_file():
        raise ValueError(f"--generation-config: {gen!r} holds no generation_config.json; expected 'auto', "
                         "'vllm' or such a folder")
    for flag, value in (("--model", args.model), ("--tokenizer", args.tokenizer)):
        # A value that looks like a path must be one; a model id ("org/name") is resolved later.
        if value and _looks_like_path(value) and not Path(value).expanduser().exists():
            raise ValueError(f"{flag}: {value!r} does not exist; expected a checkpoint folder or a model id "
                             "in the local HuggingFace cache")


def _looks_like_path(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~")) or value.count("/") > 1
