"""The ``<think>`` split, whole and streamed at every split point, and its detection and options."""

from __future__ import annotations

import pytest

from mlx_infer.errors import InvalidRequest
from mlx_infer.reasoning import ReasoningParser, detect, resolve, starts_in_reasoning, template_kwargs
from mlx_infer.tool_calls import ReasoningDelta, TextDelta

QWEN3 = (
    "<think>\nOkay, the user asks for the capital of France. That is Paris.\n</think>\n\n"
    "The capital of France is **Paris**."
)


def _split(text: str, pieces: list[str], in_reasoning: bool = False) -> tuple[str, str]:
    parser = ReasoningParser(in_reasoning)
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    return reasoning, content


def _every_split(text: str, in_reasoning: bool = False) -> tuple[str, str]:
    whole = _split(text, [text], in_reasoning)
    for k in range(len(text) + 1):
        assert _split(text, [text[:k], text[k:]], in_reasoning) == whole, k
    assert _split(text, list(text), in_reasoning) == whole
    return whole


@pytest.mark.parametrize(
    "text, in_reasoning, expected",
    [
        (
            QWEN3,
            False,
            (
                "Okay, the user asks for the capital of France. That is Paris.",
                "The capital of France is **Paris**.",
            ),
        ),
        # DeepSeek-R1: the template opens the block, the output only closes it.
        ("Let me think: 2 + 2 = 4.\n</think>\n\n4", True, ("Let me think: 2 + 2 = 4.", "4")),
        # Qwen3 with enable_thinking false: an empty block in the prompt, none in the output.
        ("Paris.", False, ("", "Paris.")),
        ("  <thinking is a word", False, ("", "  <thinking is a word")),
        # Cut off while reasoning (max_tokens): all of it is reasoning.
        ("<think>\nStill going  ", False, ("Still going", "")),
        ("<think></think>Paris", False, ("", "Paris")),
    ],
)
def test_split_whole_and_streamed(text, in_reasoning, expected):
    assert _every_split(text, in_reasoning) == expected


def test_reasoning_streams_before_the_end_marker():
    parser = ReasoningParser()
    assert parser.feed("<think>\nFirst ") == [ReasoningDelta("First")]
    assert parser.feed("step</thi") == [ReasoningDelta(" step")]
    assert parser.feed("nk>\nAnswer") == [TextDelta("Answer")]


def test_detect_and_resolve():
    assert detect("{{ '<think>\\n' }}") == "think"
    assert detect("{{ messages }}", lambda t: t == "<think>") == "think"
    assert detect("{{ messages }}") is None
    assert resolve("auto", "{{ messages }}") is None
    assert resolve("deepseek_r1", "{{ messages }}") == "think"
    assert resolve("none", "<think>") is None
    with pytest.raises(InvalidRequest, match="unknown reasoning parser"):
        resolve("nope", "")


@pytest.mark.parametrize(
    "template",
    [
        # DeepSeek-R1: drops past reasoning, and (0528) opens the block in the generation prompt.
        "{% set content = content.split('</think>')[-1] %}{{'<｜Assistant｜><think>\\n'}}",
        # DeepSeek V3.1: thinking on or off by the prompt's end.
        "{% if thinking %}{{'<｜Assistant｜><think>'}}{% else %}{{'<｜Assistant｜></think>'}}{% endif %}",
        # GLM-4.5 / 4.6 / 4.7: an empty block when thinking is off.
        "{{ '<|assistant|>' }}{% if not enable_thinking %}{{ '<think></think>' }}{% endif %}",
    ],
)
def test_deepseek_and_glm_templates_get_the_think_split(template):
    assert resolve("auto", template) == "think"


def test_prompt_ending_in_think_starts_in_reasoning():
    assert starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_template_kwargs_cannot_replace_what_the_renderer_sets():
    assert template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}
    with pytest.raises(InvalidRequest, match="messages"):
        template_kwargs({"messages": []})
