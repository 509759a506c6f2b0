"""The errors that mean "what you gave cannot be used", as opposed to a bug.

A checkpoint the engine cannot compute, a request the pool could never hold, a tokenizer file
that is missing, a package that is not installed: each is raised as a ``UserError`` with a
message that says what is wrong and what to do. The command lines (``run.py --model DIR``,
``python -m bench``) catch exactly these and print the message as one ``error:`` line, with a
non-zero exit status; anything else keeps its traceback, because anything else is a bug.

Each class also derives from the built-in exception a Python caller would expect
(``ValueError`` for bad input, ``ImportError`` for a missing package), so ``except ValueError``
keeps working for code that used the API before these classes existed.
"""

from __future__ import annotations


class UserError(Exception):
    """Input that the program cannot use: the command line prints it on one line, exits 1."""


class CheckpointError(UserError, ValueError):
    """A set of weights, a checkpoint's config or its tokenizer files that this model cannot
    take as they are."""


class RequestError(UserError, ValueError):
    """A request that cannot be served: a bad parameter, an empty prompt, a request larger than
    the KV pool. ``param`` names the offending argument (``"prompt_ids"``, ``"max_new_tokens"``,
    a ``SamplingParams`` field such as ``"temperature"``...), so that a caller such as the
    server maps it onto its own field without reading the message."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(RequestError):
    """A request longer than the model's context: prompt + max tokens past ``max_model_len``
    (vLLM's check; an OpenAI server answers it with 400 and the numbers)."""

    def __init__(self, message: str, prompt_tokens: int, max_tokens: int, max_model_len: int):
        super().__init__(message, param="max_new_tokens")
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


class ResourceError(UserError, MemoryError):
    """Work this machine cannot hold (a KV pool, weights or prompts larger than the memory it
    has): refused before anything is allocated, with the figures and what to lower."""


class MissingPackageError(UserError, ImportError):
    """An optional package that this feature needs is not installed; the message says which
    extra to install."""


def one_line(error: BaseException) -> str:
    """The error's message on one line: a list of problems (``check_weights`` lists every
    tensor that does not fit) is joined with "; " rather than printed over several lines."""
    parts = [part.strip() for part in str(error).splitlines()]
    text = "; ".join(part for part in parts if part)
    return text.replace(":;", ":")
