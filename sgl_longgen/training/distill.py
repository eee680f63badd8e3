"""Self-distilled training text: real prompts answered by the target model itself.

``sgl-longgen train distill`` builds a set of training prompts programmatically (or reads them
from a JSONL file), has the target answer each one with sampling, and writes one JSON line per
answer, ``{"id", "kind", "text", ...}``, where ``text`` is the rendered prompt followed by the
model's answer: the format ``--data FILE.jsonl`` of ``train heads|owl|longspec`` reads. Training
drafters on the model's own answers is how EAGLE and Medusa self-distil.

The built-in prompts come in three kinds, the kinds of an evaluation set such as
``configs/smollm2_heldout.jsonl``, from sources of their own:

* ``chat``: instructions from templates crossed with topics, rendered with the model's chat
  template (the answer ends where the model ends its turn);
* ``code``: the signature and docstring of a function or method of Python's standard library
  source (the corpus the shipped ``tiny`` proxy was trained on), for the model to continue;
* ``prose``: story openings from templates crossed with people and places, continued as text.

``--exclude FILE.jsonl`` names an evaluation set the prompts must stay apart from: a built-in
prompt that shares a run of six words with any of its prompts, or a code prompt for a function
it defines, is dropped. Generation is batched (left-padded) through transformers' ``generate``;
the seed fixes the prompts and the sampling on one device.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import LonggenError

CHAT_TEMPLATES = (
    "Explain {t} in simple terms.",
    "Write a short essay about {t}.",
    "What are the main advantages and disadvantages of {t}?",
    "Give me five practical tips related to {t}.",
    "Write a poem about {t}.",
    "Summarize the history of {t}.",
    "Write the opening paragraph of a blog post about {t}.",
    "How would you teach {t} to a child?",
    "Write a dialogue between two friends discussing {t}.",
    "What are common misconceptions about {t}?",
    "Describe {t} to someone who has never heard of it.",
    "Write a list of questions a student might ask about {t}, with short answers.",
)
CHAT_TOPICS = (
    "the water cycle", "machine learning", "the Roman Empire", "volcanoes", "chess", "gardening",
    "personal budgeting", "climate change", "jazz music", "the immune system", "black holes",
    "renewable energy", "the printing press", "honeybees", "public libraries", "marathon training",
    "the stock market", "coral reefs", "learning a foreign language", "electric cars", "the moon landing",
    "composting", "bread baking", "the human heart", "earthquakes", "recycling", "the internet",
    "ancient Egypt", "photography", "meditation", "rainforests", "the Olympic Games", "vaccines",
    "solar panels", "the Renaissance", "dinosaurs", "urban planning", "chemistry experiments at home",
    "cloud computing", "birdwatching", "the Silk Road", "plate tectonics", "origami", "democracy",
    "the periodic table", "friendship", "time management", "ocean tides", "the theory of evolution",
    "video game design", "bicycles", "classical music", "spreadsheets", "the human brain",
    "wind turbines", "mountain climbing", "the history of mathematics", "public speaking",
    "sorting algorithms", "databases",
)
PROSE_OPENINGS = (
    "Once upon a time, in a small {place}, there lived {person} who",
    "The letter arrived on a grey morning, and {person} read it twice before",
    "Nobody in the {place} remembered exactly when {person} had first appeared, but",
    "It had been raining for three days when {person} finally decided to leave the {place}.",
    "Chapter One\n\nThe {place} was quiet that evening. {person_cap} sat by the window and",
    "Years later, {person} would still remember the night the lights went out in the {place}.",
)
PROSE_PEOPLE = (
    "an old clockmaker", "a young doctor", "a retired sailor", "a curious girl", "a travelling musician",
    "a schoolteacher", "a baker", "a quiet librarian", "a stubborn farmer", "a famous painter",
)
PROSE_PLACES = (
    "village by the sea", "mountain town", "city", "harbour", "valley", "farmhouse", "railway station",
    "market square",
)
SKIP_STDLIB = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
               "dist-packages", "__pycache__", "pydoc_data"}
SHINGLE = 6  # words: a training prompt sharing a run this long with an excluded prompt is dropped


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str  # "chat" | "code" | "prose"
    text: str = ""  # code / prose: the text to continue
    message: str = ""  # chat: the user message


# ----------------------------------------------------------------------------------------------
# prompts


def chat_prompts() -> list[Prompt]:
    return [Prompt(f"chat-{i}-{j}", "chat", message=template.format(t=topic))
            for i, template in enumerate(CHAT_TEMPLATES) for j, topic in enumerate(CHAT_TOPICS)]


def prose_prompts() -> list[Prompt]:
    out = []
    for i, opening in enumerate(PROSE_OPENINGS):
        for j, person in enumerate(PROSE_PEOPLE):
            for k, place in enumerate(PROSE_PLACES):
                text = opening.format(person=person, person_cap=person[0].upper() + person[1:], place=place)
                out.append(Prompt(f"prose-{i}-{j}-{k}", "prose", text=text))
    return out


def code_prompts(root: Path | None = None) -> list[Prompt]:
    """``def`` line(s) plus docstring of every documented function of the standard library, in path order."""
    import sysconfig

    root = root or Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if SKIP_STDLIB & set(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = node.body[0] if node.body else None
            if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
                continue
            if len(node.body) < 2 or doc.end_lineno - node.lineno > 12:
                continue  # nothing to continue, or a docstring longer than the prompt should be
            start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            text = "".join(lines[start : doc.end_lineno]).rstrip() + "\n"
            indent = len(text) - len(text.lstrip())
            text = "".join(line[indent:] if line[:indent].isspace() else line for line in text.splitlines(keepends=True))
            out.append(Prompt(f"code-{rel.as_posix()}:{node.lineno}", "code", text=text))
    return out


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9_]+", text.lower())


def _shingles(text: str) -> set[tuple[str, ...]]:
    w = _words(text)
    return {tuple(w[i : i + SHINGLE]) for i in range(len(w) - SHINGLE + 1)}


def read_prompt_file(path: Path) -> list[Prompt]:
    """``{"id", "prompt"}`` (text to continue) or ``{"id", "messages": [{"role": "user", ...}]}`` lines."""
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            pid = str(rec.get("id", lineno))
            if "messages" in rec:
                users = [m["content"] for m in rec["messages"] if m["role"] == "user"]
                if len(users) != 1 or len(rec["messages"]) != 1:
                    raise ValueError("'messages' must hold one user message")
                out.append(Prompt(pid, "chat", message=users[0]))
            else:
                out.append(Prompt(pid, rec.get("kind", "text"), text=rec["prompt"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise LonggenError(f"{path}:{lineno}: bad prompt record ({type(exc).__name__}: {exc})") from None
    if not out:
        raise LonggenError(f"prompt file {path} has no prompts")
    return out


def apart_from(prompts: list[Prompt], excluded: list[Prompt]) -> list[Prompt]:
    """``prompts`` less any that shares a six-word run with ``excluded`` or defines a function it defines."""
    banned = set().union(*(_shingles(p.text + " " + p.message) for p in excluded)) if excluded else set()
    names = {m for p in excluded for m in re.findall(r"(?:def|function|fn|class)\s+([A-Za-z_]\w*)", p.text)}
    kept = []
    for p in prompts:
        if _shingles(p.text + " " + p.message) & banned:
            continue
        if p.kind == "code" and any(re.search(rf"\b(?:def|class)\s+{re.escape(n)}\b", p.text) for n in names):
            continue
        kept.append(p)
    return kept


def builtin_prompts(chat: int, code: int, prose: int, seed: int, excluded: list[Prompt]) -> list[Prompt]:
    """Up to ``chat`` / ``code`` / ``prose`` prompts of each kind, drawn with ``seed``."""
    rng = random.Random(seed)
    out = []
    for pool, count in ((chat_prompts(), chat), (code_prompts(), code), (prose_prompts(), prose)):
        pool = apart_from(pool, excluded)
        out += rng.sample(pool, min(count, len(pool)))
    return out


# ----------------------------------------------------------------------------------------------
# rendering and generation


def render(prompt: Prompt, tokenizer) -> str:
    """The text the model sees: a chat message through the model's chat template, else the text."""
    if prompt.kind == "chat":
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt.message}], tokenize=False,
                                             add_generation_prompt=True)
    return prompt.text


def hf_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def pick_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def generate_answers(model_dir: Path, prompts: list[Prompt], max_new_tokens: int, temperature: float, top_p: float,
                     batch_size: int, seed: int, device: str) -> list[dict]:
    """One record per prompt: ``text`` = rendered prompt + the model's sampled answer."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    tok = hf_tokenizer(model_dir)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    rendered = [render(p, tok) for p in prompts]
    lengths = [len(tok(r, add_special_tokens=False).input_ids) for r in rendered]
    order = sorted(range(len(prompts)), key=lambda i: lengths[i])  # similar lengths batch together
    torch.manual_seed(seed)
    records: dict[int, dict] = {}
    with tqdm(total=len(prompts), desc="distill", unit="answer", dynamic_ncols=True) as bar:
        for lo in range(0, len(order), batch_size):
            idx = order[lo : lo + batch_size]
            enc = tok([rendered[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            with torch.no_grad():
                out = model.generate(**enc, do_sample=temperature > 0, temperature=temperature or None,
                                     top_p=top_p if temperature > 0 else None, top_k=0, max_new_tokens=max_new_tokens,
                                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            for row, i in enumerate(idx):
                new = out[row, enc.input_ids.shape[1]:].tolist()
                ended = tok.eos_token_id in new
                if ended:
                    new = new[: new.index(tok.eos_token_id)]
                answer = tok.decode(new, skip_special_tokens=False)
                p = prompts[i]
                records[i] = {"id": p.id, "kind": p.kind, "text": rendered[i] + answer, "prompt_tokens": lengths[i],
                              "answer_tokens": len(new), "ended": ended}
            bar.update(len(idx))
    return [records[i] for i in range(len(prompts))]


def distill(model: str, out: Path, prompt_file: Path | None, exclude: list[Path], chat: int, code: int, prose: int,
            max_new_tokens: int, temperature: float, top_p: float, batch_size: int, seed: int, device: str,
            command: str = "") -> dict:
    """Build (or read) the prompts, generate the answers, write ``out`` (JSONL) and ``out``.json (provenance)."""
    from ..runtime.embedded import resolve_model

    model_dir = resolve_model(model)
    excluded = [p for path in exclude for p in read_prompt_file(path)]
    if prompt_file is not None:
        prompts = apart_from(read_prompt_file(prompt_file), excluded)
    else:
        prompts = builtin_prompts(chat, code, prose, seed, excluded)
    if not prompts:
        raise LonggenError("no training prompts left to answer")
    device = pick_device(device)
    print(f"distill: {len(prompts)} prompts ({', '.join(f'{k} {sum(p.kind == k for p in prompts)}' for k in sorted({p.kind for p in prompts}))}), "
          f"{max_new_tokens} new tokens each at temperature {temperature:g}, top-p {top_p:g}, on {device}", file=sys.stderr)
    start = time.perf_counter()
    records = generate_answers(model_dir, prompts, max_new_tokens, temperature, top_p, batch_size, seed, device)
    seconds = time.perf_counter() - start
    out.parent.mkdir(parents=True, exist_ok=True)
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    out.write_text(body, encoding="utf-8")
    answer_tokens = sum(r["answer_tokens"] for r in records)
    summary = {
        "command": command, "model": model, "model_dir": str(model_dir), "out": str(out),
        "sha256": hashlib.sha256(body.encode()).hexdigest(), "prompts": len(records),
        "kinds": {k: sum(r["kind"] == k for r in records) for k in sorted({r["kind"] for r in records})},
        "excluded": [str(p) for p in exclude], "excluded_prompts": len(excluded),
        "answer_tokens": answer_tokens, "ended_turns": sum(r["ended"] for r in records),
        "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
        "device": device, "seconds": round(seconds, 1), "tokens_per_second": round(answer_tokens / seconds, 1),
    }
    Path(str(out) + ".json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def render_prompt_file(model: str, path: Path, out: Path) -> int:
    """An evaluation set rendered for ``generate``/``eval --prompt-file``: ``{"id", "prompt", "input_ids"}``
    lines, chat messages through the model's chat template. Returns the number of prompts."""
    from ..runtime.embedded import resolve_model

    tok = hf_tokenizer(resolve_model(model))
    prompts = read_prompt_file(path)
    lines = []
    for p in prompts:
        text = render(p, tok)
        lines.append(json.dumps({"id": p.id, "prompt": text, "input_ids": tok(text, add_special_tokens=False).input_ids},
                                ensure_ascii=False))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(prompts)
