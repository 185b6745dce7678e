"""The rich console the commands print their results to."""

from __future__ import annotations

from rich.console import Console


class StdoutConsole(Console):
    """A console on stdout whose reader going away (``| head``) ends the command as every other write to
    stdout does: ``cli.main`` turns the BrokenPipeError into a quiet exit 141, where rich's own handling
    exits 1 (a failure a shell script would act on)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError
