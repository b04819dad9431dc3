"""Answer scorers, written from the benchmarks' descriptions (RULER, LongBench, SQuAD, GSM8K/MATH).

Every scorer takes ``(prediction, reference, ...)`` strings and returns a float in [0, 1].
Chinese word segmentation uses ``jieba`` when it is installed (as LongBench does) and single
characters otherwise; :data:`ZH_TOKENIZER` says which.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter

try:  # optional: LongBench's Chinese metrics segment words with jieba
    import jieba  # type: ignore[import-not-found]

    jieba.setLogLevel(60)
    ZH_TOKENIZER = "jieba"
except ImportError:
    jieba = None
    ZH_TOKENIZER = "chars"

# ---- RULER ----------------------------------------------------------------------------------------


def string_match_all(prediction: str, references: list[str]) -> float:
    """Share of the references found (case-insensitively) in the prediction (RULER's NIAH / VT metric)."""
    pred = prediction.lower()
    return sum(ref.lower() in pred for ref in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """1 if any reference is found (case-insensitively) in the prediction (RULER's QA metric)."""
    pred = prediction.lower()
    return float(any(ref.lower() in pred for ref in references))


# ---- token F1 and ROUGE-L ---------------------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ZH_PUNCT = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣"
    "､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def normalize_zh_answer(s: str) -> str:
    """Chinese normalisation: lower case, no punctuation (Chinese or ASCII), no whitespace."""
    drop = _PUNCT | set(_ZH_PUNCT)
    return "".join(ch for ch in s.lower() if ch not in drop and not ch.isspace())


def zh_tokens(s: str) -> list[str]:
    words = jieba.lcut(s) if jieba is not None else list(s)
    return [w for w in (normalize_zh_answer(x) for x in words) if w]


def token_f1(pred_tokens: list[str], ref_tokens: list[str]) -> float:
    common = Counter(pred_tokens) & Counter(ref_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, reference: str) -> float:
    """Token F1 after SQuAD normalisation (LongBench's English QA metric)."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def qa_f1_zh(prediction: str, reference: str) -> float:
    """Token F1 over normalised Chinese words (LongBench's Chinese QA metric)."""
    return token_f1(zh_tokens(prediction), zh_tokens(reference))


def lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence (O(len(a) * len(b)) time, O(len(b)) memory)."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l_tokens(pred: list[str], ref: list[str]) -> float:
    """ROUGE-L F1 (beta = 1): LCS-based precision and recall of the token sequences."""
    if not pred or not ref:
        return 0.0
    lcs = lcs_length(pred, ref)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(pred), lcs / len(ref)
    return 2 * p * r / (p + r)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 over lower-cased words (LongBench's summarisation metric)."""
    return rouge_l_tokens(_words(prediction), _words(reference))


def rouge_l_zh(prediction: str, reference: str) -> float:
    """ROUGE-L F1 over Chinese words (LongBench's Chinese summarisation / DuReader metric)."""
    return rouge_l_tokens(zh_tokens(prediction), zh_tokens(reference))


def _words(s: str) -> list[str]:
    return re.findall(r"\w+", s.lower())


# ---- LongBench's other metrics ---------------------------------------------------------------------


def classification_score(prediction: str, reference: str, all_classes: list[str]) -> float:
    """1 / (classes named in the prediction) when the gold class is among them, else 0.

    A named class that is a proper substring of the gold class (e.g. "location" inside
    "other location") is not counted against the prediction.
    """
    named = [c for c in all_classes if c in prediction]
    named = [c for c in named if c == reference or c not in reference]
    return 1.0 / len(named) if reference in named else 0.0


def _numbers(s: str) -> list[str]:
    return re.findall(r"\d+", s)


def retrieval_score(prediction: str, reference: str) -> float:
    """Passage retrieval: of the numbers in the prediction, the share equal to the gold paragraph's number.

    ``reference`` is e.g. "Paragraph 12" (English) or "段落12" (Chinese).
    """
    gold = _numbers(reference)
    found = _numbers(prediction)
    if not gold or not found:
        return 0.0
    return sum(n == gold[0] for n in found) / len(found)


def count_score(prediction: str, reference: str) -> float:
    """Passage count: of the numbers in the prediction, the share equal to the gold count."""
    found = _numbers(prediction)
    if not found:
        return 0.0
    return sum(n == str(reference).strip() for n in found) / len(found)


def code_sim_score(prediction: str, reference: str) -> float:
    """Edit similarity of the first code line of the prediction to the gold line.

    The first line that is not a comment or a Markdown fence is compared; similarity is
    difflib's ratio (2 * matches / total length), in [0, 1].
    """
    line = ""
    for candidate in prediction.lstrip("\n").split("\n"):
        if not candidate.strip().startswith(("`", "#", "//")):
            line = candidate
            break
    return difflib.SequenceMatcher(None, line, reference).ratio()


def first_line(prediction: str) -> str:
    """The first line of a prediction (LongBench scores few-shot tasks on it: the model may go on
    to invent the next example)."""
    return prediction.lstrip("\n").split("\n")[0]


# ---- math ---------------------------------------------------------------------------------------------


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def gsm8k_gold(answer: str) -> str:
    """The final number of a GSM8K solution ("... #### 1,234" -> "1234")."""
    return answer.split("####")[-1].strip().replace(",", "")


def extract_math_answer(text: str) -> str | None:
    """The final answer of a chain of thought: the last ``\\boxed{}``, else "answer is X", else the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    m = re.findall(r"answer is:?\s*\$?([^\n$]+?)\$?(?:\.\s|\.?$|\n)", text)
    if m:
        return m[-1].strip()
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def normalize_math(s: str) -> str:
    """Canonical text of a final answer: LaTeX spacing/sizing, units of degrees and percent, ``\\text{}``,
    ``dfrac``, a leading ``x =``, thousands separators and unbraced ``\\frac12`` / ``\\sqrt2`` removed or fixed."""
    s = s.strip()
    s = re.sub(r"\\(?:text|mbox|mathrm|textbf|mathbf)\{([^{}]*)\}", r"\1", s)
    for junk in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "^\\circ", "^{\\circ}", "\\circ", "\\%", "%"):
        s = s.replace(junk, "")
    s = s.replace("\\$", "").replace("$", "").replace("dfrac", "frac").replace("tfrac", "frac")
    s = s.strip().rstrip(".").strip()
    m = re.fullmatch(r"[a-zA-Z]\s*=\s*(.+)", s)
    if m:
        s = m.group(1)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s.lower()


def _as_number(s: str) -> float | None:
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}", s) or re.fullmatch(
        r"(-?)(\d+(?:\.\d+)?)/(\d+(?:\.\d+)?)", s
    )
    try:
        if m:
            value = float(m.group(2)) / float(m.group(3))
            return -value if m.group(1) else value
        return float(s)
    except (ValueError, ZeroDivisionError):
        return None


def math_equal(prediction: str | None, reference: str) -> bool:
    """Whether two final answers agree after :func:`normalize_math` (textually, or as numbers /
    simple fractions to a relative 1e-6). Not a symbolic checker: ``\\sqrt{8}`` != ``2\\sqrt{2}``."""
    if prediction is None:
        return False
    a, b = normalize_math(prediction), normalize_math(reference)
    if a == b:
        return True
    x, y = _as_number(a), _as_number(b)
    return x is not None and y is not None and abs(x - y) <= 1e-6 * max(1.0, abs(y))
