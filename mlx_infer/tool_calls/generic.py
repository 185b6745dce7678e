"""The fallback for models without a known format: a JSON call object (or a list of them) as the whole
answer, or in a ```json fence; only names of the request's tools count as calls."""

from __future__ import annotations

from collections.abc import Collection

from mlx_infer.tool_calls.base import NO_PARAMETERS, JsonCallParser, Parameters, ToolFamily, ToolParser


class Generic(ToolFamily):
    name = "generic"
    starts = ("```json",)
    end = "```"
    bare_at_start = True

    def parser(self, tool_names: Collection[str], parameters: Parameters = NO_PARAMETERS) -> ToolParser:
        # A ```json fence may hold any JSON the user asked for: only a tool's name makes it a call.
        return JsonCallParser(self.starts, self.end, True, tool_names, any_name_in_regions=False)
