"""RULER-style long-context retrieval tasks, generated from a seed (nothing
downloaded): prompts of exactly the requested number of tokens, the question
at the end, scored by substring match of the expected values in a short
greedy answer.

Tasks (after RULER, Hsieh et al. 2024, whose templates these follow):

* ``passkey``: one 5-digit pass key at a random depth
  ("The pass key is 12345. Remember it.");
* ``multikey``: the asked key among 7 distractors, each needle
  "The special magic number for <word> is <number>." (7-digit numbers, all
  keys and numbers distinct), all at random depths;
* ``multivalue``: 4 needles of one key, each with its own number; the answer
  must hold all 4 numbers;
* ``vartrack``: a chain of assignments ``VAR ABCDE = 12345``,
  ``VAR FGHIJ = VAR ABCDE``, ... (5 variables, 4 hops) in order at random
  depths; the question asks which variables hold the value; the answer must
  name every variable of the chain (``exact`` also requires that it names no
  other 5-letter capitalised name).

Filler (the haystack), both shipped with the standard library, per task as
RULER chooses between its repeated "noise" sentences and natural essays:

* ``zen`` for ``passkey`` and ``vartrack`` (RULER: noise): the Zen of
  Python, ``this.s`` decoded (rot13), repeated: a haystack the needles stand
  out from;
* ``docs`` for ``multikey`` and ``multivalue`` (RULER: essays): the text of
  the Python documentation's topics, ``pydoc_data.topics`` (the text the
  perplexity runs of ``model_quality.py`` read), its paragraphs in order.

Either starts at a seeded offset. Keys, numbers and variable names are drawn
so that none occurs in the filler's text: each expected value appears in the
prompt exactly where its needle is.

Prompts are token ids: ``Generator(encode)`` takes the model's tokenizer as
a function from text to ids (no special tokens); ``prefix`` (e.g. the BOS
token) counts toward the length. The intro, each needle and the question are
encoded separately and the filler's ids are cut to fill the rest exactly, so
every needle's ids appear whole at the offset ``Sample.at`` records.
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Callable, Sequence

from stem_indexer.operator.contract import fail

TASKS = ("passkey", "multikey", "multivalue", "vartrack")
# Greedy answer tokens per task: room for the expected values, each digit
# or letter possibly its own token, and their separators.
ANSWER_TOKENS = {"passkey": 8, "multikey": 12, "multivalue": 40, "vartrack": 32}
MULTIKEY_DISTRACTORS = 7
MULTIVALUE_VALUES = 4
VARTRACK_HOPS = 4

PASSKEY_INTRO = ("There is an important number hidden inside a lot of irrelevant text. Find it "
                 "and memorize it. I will quiz you about it.\n")
PASSKEY_NEEDLE = "\nThe pass key is {key}. Remember it.\n"
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"
MAGIC_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to "
               "memorize it. I will quiz you about the numbers afterwards.\n")
MAGIC_NEEDLE = "\nThe special magic number for {word} is {number}.\n"
MULTIKEY_QUESTION = ("\nWhat is the special magic number for {word} mentioned in the provided "
                     "text? The special magic number for {word} mentioned in the provided text is")
MULTIVALUE_QUESTION = ("\nWhat are all the special magic numbers for {word} mentioned in the "
                       "provided text? The special magic numbers for {word} mentioned in the "
                       "provided text are")
VARTRACK_INTRO = ("Memorize and track the chain(s) of variable assignment hidden in the "
                  "following text.\n")
VARTRACK_NEEDLE = "\nVAR {name} = {value}.\n"
VARTRACK_QUESTION = ("\nQuestion: Find all variables that are assigned the value {value} in the "
                     "text above. Answer: According to the chain(s) of variable assignment in the "
                     "text above, {count} variables are assigned the value {value}, they are:")
# Keys of the magic-number tasks: "<adjective>-<noun>", as RULER draws them.
ADJECTIVES = ("ancient", "brave", "calm", "damp", "eager", "faint", "gentle", "hollow", "icy",
              "jolly", "keen", "lively", "mellow", "noisy", "odd", "plain", "quiet", "rapid",
              "shy", "tidy", "upbeat", "vast", "witty", "young")
NOUNS = ("anchor", "badger", "candle", "dolphin", "engine", "falcon", "garden", "harbor",
         "island", "jacket", "kettle", "lantern", "meadow", "needle", "orchard", "pepper",
         "quarry", "river", "saddle", "tunnel", "umbrella", "valley", "walnut", "yacht")
VAR_NAME = re.compile(r"\b[A-Z]{5}\b")
FILLERS = ("zen", "docs")
TASK_FILLER = {"passkey": "zen", "multikey": "docs", "multivalue": "docs", "vartrack": "zen"}


@dataclasses.dataclass(frozen=True)
class Sample:
    """One prompt: ``ids`` (exactly ``length`` tokens), the values the answer
    must contain (``expected``), the needles' texts and where their ids start
    in ``ids`` (``at``, in order of appearance), the answer's token budget and
    the filler used."""

    task: str
    length: int
    seed: int
    ids: list[int]
    expected: tuple[str, ...]
    needles: tuple[str, ...]
    at: tuple[int, ...]
    max_new_tokens: int
    filler: str


def filler_text(kind: str = "docs") -> str:
    """The haystack's text: ``docs``, the documentation's topics
    (``pydoc_data.topics``); ``zen``, the Zen of Python (``this.s`` read from
    the module's source and decoded; importing ``this`` would print it)."""
    if kind == "zen":
        import ast
        import codecs
        import importlib.util
        tree = ast.parse(open(importlib.util.find_spec("this").origin).read())
        encoded = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                       and getattr(n.targets[0], "id", None) == "s")
        return codecs.decode(encoded, "rot13") + "\n\n"
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def score(expected: Sequence[str], answer: str) -> bool:
    """Every expected value occurs in the answer (substring match)."""
    return all(value in answer for value in expected)


def exact_names(expected: Sequence[str], answer: str) -> bool:
    """The answer's 5-letter capitalised names are exactly ``expected`` (vartrack)."""
    return set(VAR_NAME.findall(answer)) == set(expected)


class Generator:
    """Samples of the tasks for one tokenizer (``encode``: text to ids, no
    special tokens), each prompt starting with ``prefix``; ``filler``: one of
    ``FILLERS`` for every task (default: ``TASK_FILLER``'s), or ``text``,
    the filler's text itself."""

    def __init__(self, encode: Callable[[str], list[int]], prefix: Sequence[int] = (),
                 text: str | None = None, filler: str | None = None):
        if filler is not None and filler not in FILLERS:
            fail("Generator", "filler", f"must be None or one of {', '.join(FILLERS)}",
                 repr(filler))
        self.encode = encode
        self.prefix = list(prefix)
        self.text = text
        self.filler = filler
        self._texts: dict[str, str] = {}
        self._ids: dict[str, list[int]] = {}

    def filler_of(self, task: str) -> str:
        """The filler a task's prompts use ("text" when given one)."""
        return "text" if self.text is not None else self.filler or TASK_FILLER[task]

    def filler_text(self, kind: str) -> str:
        if kind not in self._texts:
            self._texts[kind] = self.text if kind == "text" else filler_text(kind)
        return self._texts[kind]

    def filler_ids(self, kind: str) -> list[int]:
        if kind not in self._ids:
            self._ids[kind] = list(self.encode(self.filler_text(kind)))
        return self._ids[kind]

    # -- values that do not occur in the filler -------------------------------

    def _fresh(self, rng: random.Random, draw: Callable[[], str], taken: set[str],
               text: str) -> str:
        for _ in range(1000):
            value = draw()
            if value not in taken and value not in text:
                taken.add(value)
                return value
        raise RuntimeError("could not draw a value absent from the filler")  # pragma: no cover

    def sample(self, task: str, length: int, seed: int) -> Sample:
        """The prompt of ``task`` with ``length`` tokens drawn from ``seed``."""
        who = "Generator.sample"
        if task not in TASKS:
            fail(who, "task", f"must be one of {', '.join(TASKS)}", repr(task))
        if isinstance(length, bool) or not isinstance(length, int):
            fail(who, "length", "must be an int", repr(length))
        rng = random.Random(f"{task}:{length}:{seed}")
        taken: set[str] = set()
        kind = self.filler_of(task)
        text = self.filler_text(kind)

        def number(digits: int) -> str:
            return self._fresh(rng, lambda: str(rng.randrange(10 ** (digits - 1), 10 ** digits)),
                               taken, text)

        def key() -> str:
            return self._fresh(rng, lambda: f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}", taken,
                               text)

        if task == "passkey":
            value = number(5)
            intro, needles = PASSKEY_INTRO, [PASSKEY_NEEDLE.format(key=value)]
            question, expected, ordered = PASSKEY_QUESTION, (value,), False
        elif task == "multikey":
            words = [key() for _ in range(1 + MULTIKEY_DISTRACTORS)]
            numbers = [number(7) for _ in words]
            intro = MAGIC_INTRO
            needles = [MAGIC_NEEDLE.format(word=w, number=n) for w, n in zip(words, numbers)]
            question, expected = MULTIKEY_QUESTION.format(word=words[0]), (numbers[0],)
            ordered = False
        elif task == "multivalue":
            word = key()
            numbers = [number(7) for _ in range(MULTIVALUE_VALUES)]
            intro = MAGIC_INTRO
            needles = [MAGIC_NEEDLE.format(word=word, number=n) for n in numbers]
            question, expected = MULTIVALUE_QUESTION.format(word=word), tuple(numbers)
            ordered = False
        else:  # vartrack
            value = number(5)
            names = [self._fresh(rng, lambda: "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
                                                      for _ in range(5)), taken, text)
                     for _ in range(VARTRACK_HOPS + 1)]
            intro = VARTRACK_INTRO
            needles = [VARTRACK_NEEDLE.format(name=names[0], value=value)]
            needles += [VARTRACK_NEEDLE.format(name=b, value=f"VAR {a}")
                        for a, b in zip(names, names[1:])]
            question = VARTRACK_QUESTION.format(value=value, count=len(names))
            expected, ordered = tuple(names), True
        if not ordered:
            rng.shuffle(needles)  # the asked needle anywhere among the others
        return self._assemble(who, task, length, seed, rng, intro, needles, question, expected,
                              kind)

    def _assemble(self, who, task, length, seed, rng, intro, needles, question,
                  expected, kind) -> Sample:
        head = self.prefix + list(self.encode(intro))
        tail = list(self.encode(question))
        parts = [list(self.encode(n)) for n in needles]
        room = length - len(head) - len(tail) - sum(map(len, parts))
        if room < 0:
            fail(who, "length", f"must be at least {length - room} tokens for {task} "
                 "(intro, needles and question)", length)
        filler = self.filler_ids(kind)
        start = rng.randrange(len(filler))
        body = (filler[start:] + filler) * (room // len(filler) + 1)
        body = body[:room]
        cuts = sorted(rng.randint(0, room) for _ in parts)  # depths, in order
        ids, at, prev = list(head), [], 0
        for cut, part in zip(cuts, parts):
            ids += body[prev:cut]
            at.append(len(ids))
            ids += part
            prev = cut
        ids += body[prev:] + tail
        assert len(ids) == length
        return Sample(task, length, seed, ids, tuple(expected), tuple(needles), tuple(at),
                      ANSWER_TOKENS[task], kind)
