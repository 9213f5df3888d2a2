"""CUDA C kept in Python strings, rendered per spec with ``#line`` directives.

A piece of CUDA is declared with :func:`cuda_source` in the module that owns it::

    SYNC = cuda_source("sync", r'''
    __device__ ...
    ''', requires=("base",))

Kernel templates use ``$NAME`` placeholders (``string.Template``: no clash with C++
braces) filled from the spec. Shared device code is included by name through
``requires``; :func:`render` orders the pieces so each comes after what it requires, and
puts a ``#line`` before each so compiler errors name the Python file and line.
"""

from __future__ import annotations

import string
import sys
from dataclasses import dataclass
from pathlib import Path

_PACKAGE_PARENT = Path(__file__).resolve().parents[2]
_SOURCES: dict[str, "CudaSource"] = {}


@dataclass(frozen=True)
class CudaSource:
    """A named piece of CUDA text and where it lives in Python."""

    name: str
    text: str
    file: str        # path as written in #line (relative to the checkout when possible)
    line: int        # line of `file` holding the first line of `text`
    requires: tuple[str, ...] = ()
    headers: tuple[str, ...] = ()   # system headers, e.g. "cuda_bf16.h"


def _display_path(path: str) -> str:
    resolved = Path(path).resolve()
    try:
        return str(resolved.relative_to(_PACKAGE_PARENT))
    except ValueError:
        return str(resolved)


def _locate(text: str, file: str, call_line: int) -> int:
    """Line of `file` where `text` starts; the call's line if the literal is not verbatim."""
    try:
        content = Path(file).read_text()
    except OSError:
        return call_line
    offset = content.find(text)
    if offset < 0:
        return call_line
    return content.count("\n", 0, offset) + 1


def cuda_source(name: str, text: str, *, requires: tuple[str, ...] = (),
                headers: tuple[str, ...] = (), register: bool = True) -> CudaSource:
    """Declare CUDA text; shared pieces are registered so others can require them by name."""
    frame = sys._getframe(1)
    file = frame.f_code.co_filename
    source = CudaSource(name, text, _display_path(file), _locate(text, file, frame.f_lineno),
                        tuple(requires), tuple(headers))
    if register:
        existing = _SOURCES.get(name)
        if existing is not None and (existing.file, existing.line) != (source.file, source.line):
            raise ValueError(f"mkrt.jit: CUDA source {name!r} declared twice: "
                             f"{existing.file}:{existing.line} and {source.file}:{source.line}")
        _SOURCES[name] = source
    return source


def get_source(name: str) -> CudaSource:
    try:
        return _SOURCES[name]
    except KeyError:
        # The jit layer knows no kernels: pieces exist once their module is imported.
        raise KeyError(f"mkrt.jit: no CUDA source named {name!r}; known: {sorted(_SOURCES)} "
                       "(import the module that declares it, e.g. mkrt.kernels.device)") from None


def _ordered(kernel: CudaSource) -> list[CudaSource]:
    """Depth-first order: every piece after the pieces it requires, each once."""
    order: list[CudaSource] = []
    visiting: set[str] = set()
    done: set[str] = set()

    def visit(piece: CudaSource):
        if piece.name in done:
            return
        if piece.name in visiting:
            raise ValueError(f"mkrt.jit: CUDA sources require each other in a cycle at {piece.name!r}")
        visiting.add(piece.name)
        for name in piece.requires:
            visit(get_source(name))
        visiting.discard(piece.name)
        done.add(piece.name)
        order.append(piece)

    visit(kernel)
    return order


def _value_text(key: str, value) -> str:
    if isinstance(value, bool):
        text = "true" if value else "false"
    else:
        text = str(value)
    if "\n" in text:
        raise ValueError(f"mkrt.jit: template value {key}={text!r} spans lines; "
                         "that would shift every #line after it")
    return text


def render(kernel: CudaSource, params: dict[str, object], *, banner: str = "") -> str:
    """Full translation unit for `kernel` with `params` substituted into its text."""
    values = {key: _value_text(key, value) for key, value in params.items()}
    pieces = _ordered(kernel)
    headers: list[str] = []
    for piece in pieces:
        headers.extend(h for h in piece.headers if h not in headers)
    out = []
    if banner:
        out.extend(f"// {line}" for line in banner.splitlines())
    out.extend(f"#include <{h}>" for h in headers)
    for piece in pieces:
        text = piece.text
        if piece is kernel:
            try:
                text = string.Template(text).substitute(values)
            except KeyError as error:
                raise KeyError(f"mkrt.jit: template {kernel.name!r} needs ${error.args[0]}, "
                               f"which the spec does not give (given: {sorted(values)})") from None
            except ValueError as error:
                raise ValueError(f"mkrt.jit: template {kernel.name!r}: {error}") from None
        out.append(f'#line {piece.line} "{piece.file}"')
        out.append(text)
    return "\n".join(out) + "\n"
