"""Which legacy encoding a text file is in, when it is not UTF-8.

charset-normalizer ranks the encodings a file's bytes decode in; on long texts its first guess is
right, but on short ones, or on mostly-English files with a few Chinese or accented words, it
picks encodings whose decoded text no writer would produce: a GBK name read as cp949 gives Korean
syllables mixed with Chinese characters ("王小明" -> "珙鬼츠"), Latin-1 read as cp775 gives Baltic
letters in French words ("Résumé" -> "Rķsumķ").

So its guess is checked by how *plausible* the decoded text is: real text keeps to one script
(Chinese, Japanese kana with kanji, Korean Hangul, Cyrillic, Greek, Latin in one language's
letters), mostly its common letters (for Chinese characters: the common ones of GB2312, Big5 and
JIS), each where real text puts it (no Cyrillic letter inside a Latin word, no accented letter on
a digit, no capital after a small letter, no stray sign on a word). Latin letters are scored by
language: counted as Latin letters alike, a French line's "é"s beside a Lithuanian "ą" ("à" read
as cp1257) scored 0.96, too close to cp1252's 1.0 to replace a plausible first guess. When the first
guess scores low, the best-scoring decoding (one charset-normalizer found, or GB18030 or cp1252,
the legacy encodings of most of our users' files) is taken. A plausible first guess gives way
only to GB18030 or cp1252 scoring clearly higher (by :data:`MARGIN`): "Python编程入门：变量、函数和类。"
in GBK read as cp949 scores 0.9 (its Hangul syllables are common letters too) where GB18030
scores 1.0; between charset-normalizer's own candidates its order holds (our scale put EUC-KR with
bullets read as EUC-JIS kanji above the Hangul it was). Scores that cannot tell (a short string
that is plausible in two encodings) keep charset-normalizer's order.

Where cp1252 would be taken and charset-normalizer names before it a decoding with Latin Extended
letters (cp1250's Hungarian "ő", Czech "ř"), the two are ranked again by language
(:func:`_by_language`): Western Europe's languages each alone, another one's letter counting as a
rarer one outside capitalised words (names), and the Central European letters as common ones.
Scored as one alphabet, the Latin-1 letters cp1252 makes of Central European ones ("Árvíztûrõ":
Portuguese "õ" beside French "û"; Czech "dobøe") read as plausible western text and outscored the
right reading, whose Latin Extended letters weigh 0.6 (1.0 against 0.891). The coarse score still
decides what is plausible, so a western line with a foreign name ("Ødegaard arrive à la gare à
midi.") keeps its 1.0 against any other decoding; ties go to cp1252 ("Is with Åsa Málaga." is no
"Ĺsa"). Where no
decoding reads as plausible, the best-scoring one is taken still, unless UTF-16 without a byte
order mark reads as plausible (Chinese saved as UTF-16 by a Windows tool that wrote no mark;
charset-normalizer's own UTF-16 guesses are not used, being what it says of short texts it cannot
place).

Only a sample of each decoding is scored (:func:`scored_sample`): scoring is a Python loop over
characters (~1 µs each), so scoring whole decodings took ~8 s a MB of a legacy file and ~65x its
size in memory. The sample tells the encodings apart as well; each candidate is decoded whole
(so one that fails late is dropped) but only the chosen one's text is kept.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from dataclasses import dataclass

__all__ = ["Guess", "detect_legacy", "plausibility", "scored_sample"]

PLAUSIBLE = 0.9  # a decoding scoring at least this reads as real text in one script
MARGIN = 0.05  # a decoding must score this much above charset-normalizer's plausible first guess to replace it
FALLBACKS = ("gb18030", "cp1252")  # tried besides charset-normalizer's candidates
SAMPLE_CHARS = 1 << 17  # non-ASCII runs scored at most (256 KB of GBK); past it, SAMPLE_WINDOWS windows of them
SAMPLE_WINDOWS = 16

# (first, last, script, weight): weight < 1 for letters that are rarer in real text
_RANGES = (
    (0x00C0, 0x00FF, "latin", 1.0),
    (0x0100, 0x024F, "latin", 0.6),
    (0x1E00, 0x1EFF, "latin", 0.6),
    (0x0386, 0x03CE, "greek", 1.0),
    (0x0401, 0x045F, "cyrillic", 1.0),
    (0x0460, 0x052F, "cyrillic", 0.6),
    (0x0590, 0x05FF, "hebrew", 1.0),
    (0x0600, 0x06FF, "arabic", 1.0),
    (0x0E00, 0x0E7F, "thai", 1.0),
    (0x3040, 0x30FF, "kana", 1.0),
    (0xFF66, 0xFF9F, "kana", 0.6),
    (0x3400, 0x4DBF, "han", 0.6),
    (0x4E00, 0x9FFF, "han", 1.0),
    (0xF900, 0xFAFF, "han", 0.6),
    (0xAC00, 0xD7A3, "hangul", 1.0),
    (0x1100, 0x11FF, "hangul", 0.6),
    (0x3130, 0x318F, "hangul", 0.6),
)
# what a script's text is made of: Japanese mixes kana and kanji; Korean is Hangul
_WRITING = {"japanese": ("kana", "han")}
# the non-ASCII letters of the languages the Latin legacy code pages were made for (each with its
# capitals): real text keeps to one of them, so a French text's "é" beside a Lithuanian "ą" is
# "à" read as cp1257. Western Europe's languages share one, Latin-1's letters (and French "œ"), as
# their texts mix each other's words and names
_LATIN_LANGUAGES = {
    "western": "àáâãäåæçèéêëìíîïðñòóôõöøùúûüýþÿßœ",
    "polish": "ąćęłńóśźż",
    "czech": "áčďéěíňóřšťúůýž",
    "slovak": "áäčďéíĺľňóôŕšťúýž",
    "hungarian": "áéíóöőúüű",
    "croatian": "čćđšž",  # and Slovene, Bosnian, Serbian in Latin letters
    "romanian": "ăâîșțşţ",
    "lithuanian": "ąčęėįšųūž",
    "latvian": "āčēģīķļņšūž",
    "estonian": "äõöüšž",
    "finnish": "äöåšž",
    "turkish": "çğıİöşüâîû",
    "maltese": "àèìòùċġħż",
    "esperanto": "ĉĝĥĵŝŭ",
    "welsh": "àáâäèéêëìíîïòóôöùúûüýÿŵŷẁẃẅỳ",
    # Chinese in Latin letters, its tones marked (GBK holds these letters): without it, pinyin in a
    # GBK file, its letters spread over the languages above, read as cp932's half-width kana
    # ("Wǒ shì xuésheng" as "Wｨｯ shｨｬ xuｨｦsheng")
    "pinyin": "āáǎàēéěèīíǐìōóǒòūúǔùüǖǘǚǜê",
}
# Western Europe's languages each alone, for :func:`_by_language` (Finnish and Estonian, whose "š ž"
# are not Latin-1's, are scored as :data:`_LATIN_LANGUAGES` has them)
_WESTERN = {
    "french": "àâæçéèêëîïôœùûüÿ",
    "german": "äöüß",
    "spanish": "áéíóúñü",
    "portuguese": "áâãàçéêíóôõú",
    "italian": "àèéìíîòóù",
    "catalan": "àçèéíïòóúü",
    "dutch": "áéíóúèêëïöü",
    "danish": "æøåé",  # and Norwegian
    "swedish": "åäöé",
    "icelandic": "áðéíóúýþæö",
}
# what another western language's letter weighs in a western language's text, by language, outside
# a capitalised word (a name: "Søren" in French counts fully): as much as a Latin Extended letter
FOREIGN = 0.6
# punctuation and symbols any script's text may hold: neither for nor against a decoding
_NEUTRAL = frozenset("\u00a0¡«»°·§©®±×÷¿–—‘’“”„…•€™")


RARE_HAN = 0.3  # a Chinese character outside the common sets below
# what charset-normalizer may guess for a short Latin-1 file and no one writes text files in:
# EBCDIC ("Café" -> "ä/ÃZ"), HP Roman-8 and Mac Icelandic ("piñata" -> "piþata", "Straße" -> "Straþe")
_NEVER_TEXT = frozenset({"cp037", "cp273", "cp424", "cp500", "cp875", "cp1026", "cp1140", "hp_roman8", "mac_iceland"})


@functools.cache
def _common_han() -> frozenset[str]:
    """The common characters of Chinese and Japanese: GB2312 level 1 (3,755 simplified), Big5
    level 1 (5,401 traditional), JIS X 0208 level 1 (2,965 kanji). A wrong legacy decoding of
    CJK bytes lands mostly outside them (GBK's 密码 read as Big5 gives 躇鎢)."""
    common = set()
    for codec, leads, trails in (
        ("gb2312", range(0xB0, 0xD8), range(0xA1, 0xFF)),
        ("big5", range(0xA4, 0xC6), [*range(0x40, 0x7F), *range(0xA1, 0xFF)]),
        ("euc_jp", range(0xB0, 0xD0), range(0xA1, 0xFF)),
    ):
        for lead in leads:
            for trail in trails:
                try:
                    common.add(bytes((lead, trail)).decode(codec))
                except UnicodeDecodeError:
                    pass
    return frozenset(common)


def _script(char: str) -> tuple[str, float] | None:
    """(script, weight) of a non-ASCII letter; ("", 0) for anything odd; None for neutral marks."""
    code = ord(char)
    if char in _NEUTRAL or 0x2000 <= code <= 0x206F or 0x3000 <= code <= 0x303F or 0xFF01 <= code <= 0xFF65:
        return None
    # arrows, ①, shapes (■ ○ ▶), ★ ☎: bullets of any script; not box drawing or blocks (U+2500-259F),
    # which are what DOS code pages (cp437, cp866) make of other encodings' letters
    if 0x2190 <= code <= 0x21FF or 0x2460 <= code <= 0x24FF or 0x25A0 <= code <= 0x26FF:
        return None
    for first, last, script, weight in _RANGES:
        if first <= code <= last:
            if script == "han" and char not in _common_han():
                return script, RARE_HAN
            return script, weight
    if unicodedata.category(char) in ("Zs", "Sc"):  # spaces, currency signs (£, ¥)
        return None
    return "", 0.0


# alphabets whose letters never share a word with ASCII letters ("Rщsumщ" is cp1252 read as cp1125)
_ALPHABETS = frozenset({"greek", "cyrillic", "hebrew", "arabic", "thai"})
_CJK = frozenset({"han", "kana", "hangul"})
# marks that may stand between two letters ("don’t", "mid–word"; "·" only in Catalan "l·l"); other
# symbols do not ("Se±or")
_INSIDE_WORDS = frozenset("‘’“”–—…·\u00a0")
# punctuation real text puts on a word ("¿Dónde", "¡Hola", "etc…"), footnote and reference marks
# ("report†", "Author‡,", "†University A", "※git") and bullets ("•Première étape"); other
# punctuation and math signs (Unicode's "Po" and "Sm": "‰", "·" outside "l·l", "×", arrows) on a
# Latin letter are odd, but by a digit ("5°C×3") and in CJK text, which spaces no words
# ("※Windows版", "点击→Python"): "andr‗" is "andrò" read as cp850, "P·blica" "Pública" as cp1125,
# "｡hola" "¡hola" as cp932, "×e" Czech "že" as cp852. Mac Roman's "Voil‡" for "Voilà" reads as a
# footnote mark so: "cÙtÈ" gives most French away, not a line whose only accent is "à"
_ON_WORDS = frozenset("¡¿…†‡•※")
# of those, the ones that only open a word or an item: after a letter "•" and "※" are cp437's and
# cp850's "ò" ("Per•" is "Però")
_BEFORE_WORDS = frozenset("•※")


def _cjk_punctuation(char: str) -> bool:
    """Full-width punctuation of Chinese and Japanese text (、。「」 U+3000-303F; ，：？（） U+FF01-FF0F,
    U+FF1A-FF20), which stands between Latin words there ("ls、cd、grep"). Not the half-width
    forms U+FF61-FF65, which are how cp932 reads Latin-1 bytes."""
    code = ord(char)
    return 0x3000 <= code <= 0x303F or 0xFF01 <= code <= 0xFF0F or 0xFF1A <= code <= 0xFF20


def _odd_here(text: str, i: int, script: str | None, cjk_runs: bool) -> bool:
    """Whether the non-ASCII character at ``i`` sits where real text never puts it: a letter of a
    non-Latin alphabet touching an ASCII letter, an accented Latin letter touching a digit ("ú40"
    is "£40" misread) or a capital one after a small letter ("cÙtÈ" is "côté" read as Mac Roman),
    a symbol between two letters or one real text never puts by a word on a Latin letter
    ("andr‗"), a CJK character touching an ASCII letter in a text with no two CJK characters in a
    row (Chinese next to Latin words, "用Python写代码", has runs of them). Full-width CJK
    punctuation between Latin words is not odd ("ls、cd")."""
    char = text[i]
    before = text[i - 1] if i else " "
    after = text[i + 1] if i + 1 < len(text) else " "
    if script in _ALPHABETS:
        return any(c < "\x80" and c.isalpha() for c in (before, after))
    if script == "latin":  # "3ème" is French; "ú40" is not
        if char.isupper() and before.islower() and _latin_letter(before):
            return True
        return any(c < "\x80" and c.isdigit() for c in (before, after)) and not any(
            c < "\x80" and c.isalpha() for c in (before, after)
        )
    if script in _CJK and not cjk_runs:  # lone CJK characters on Latin words ("S縊 Paulo" is "São" read as cp932)
        return any(c < "\x80" and c.isalpha() for c in (before, after))
    if script is None:  # on Latin letters only: "，" between Chinese characters is punctuation
        if _cjk_punctuation(char):
            return False
        on_letters = _latin_letter(before), _latin_letter(after)
        if all(on_letters):
            return char not in _INSIDE_WORDS or (char == "·" and (before + after).lower() != "ll")
        return (
            any(on_letters)
            and not cjk_runs
            and not (before.isdigit() or after.isdigit())
            and (char not in _ON_WORDS or (char in _BEFORE_WORDS and on_letters[0]))
            and unicodedata.category(char) in ("Po", "Sm")
        )
    return False


def _latin_letter(char: str) -> bool:
    if char < "\x80":
        return char.isalpha()
    found = _script(char)
    return found is not None and found[0] == "latin"


def plausibility(text: str, by_language: bool = False) -> float:
    """How much of ``text``'s non-ASCII part reads as one writing system's common letters (0-1);
    1.0 for pure ASCII. ``by_language``: Western Europe's languages scored each alone, another
    one's letter outside a capitalised word weighing :data:`FOREIGN`, and Latin Extended letters
    weighing as common ones (for :func:`_by_language` only: short western lines read as Czech or
    Polish scored so, "Très" as "Trčs")."""
    weights: dict[str, float] = {}
    latin: dict[str, float] = {}  # each Latin letter's weight, scored by _LATIN_LANGUAGES
    named: dict[str, float] = {}  # by_language: the weight of each Latin letter in capitalised words
    counted = 0
    scripts = [_script(c) if c >= "\x80" else None for c in text]
    cjk = [bool(found) and found[0] in _CJK for found in scripts]
    cjk_runs = any(a and b for a, b in zip(cjk, cjk[1:]))
    for i, char in enumerate(text):
        if char < "\x80":
            continue
        found = scripts[i]
        if _odd_here(text, i, found and found[0], cjk_runs):
            found = ("", 0.0)
        if found is None:
            continue
        counted += 1
        script, weight = found
        if script == "latin":
            if by_language and _latin_extended(char):
                weight = 1.0
            latin[char] = latin.get(char, 0.0) + weight
            if by_language and _capitalised(text, i):
                named[char] = named.get(char, 0.0) + weight
        elif script:
            weights[script] = weights.get(script, 0.0) + weight
    if not counted:
        return 1.0
    scores = dict(weights)
    for writing, scripts in _WRITING.items():
        scores[writing] = sum(weights.get(s, 0.0) for s in scripts)
    for language, letters in _latin_letters().items():
        if not (by_language and language == "western"):
            scores[language] = sum(weight for char, weight in latin.items() if char in letters)
    if by_language:
        western = _latin_letters()["western"]
        for language, letters in _western_letters().items():
            scores[language] = sum(
                weight if char in letters else named.get(char, 0.0) + FOREIGN * (weight - named.get(char, 0.0))
                for char, weight in latin.items()
                if char in letters or char in western
            )
    return max(scores.values(), default=0.0) / counted


def _latin_extended(char: str) -> bool:
    """A Latin Extended-A or -B letter (cp1250's "ő ř ł", not Latin-1's)."""
    return 0x100 <= ord(char) <= 0x24F


def _capitalised(text: str, i: int) -> bool:
    """Whether the Latin letter at ``i`` is in a word whose first letter is a capital."""
    while i and _latin_letter(text[i - 1]):
        i -= 1
    return text[i].isupper()


@functools.cache
def _western_letters() -> dict[str, frozenset[str]]:
    """:data:`_WESTERN` with each letter's capital."""
    return {language: _with_capitals(letters) for language, letters in _WESTERN.items()}


def _with_capitals(letters: str) -> frozenset[str]:
    return frozenset(letters) | {c.upper() for c in letters if len(c.upper()) == 1 and c.upper() >= "\x80"}


@functools.cache
def _latin_letters() -> dict[str, frozenset[str]]:
    """:data:`_LATIN_LANGUAGES` with each letter's capital."""
    return {language: _with_capitals(letters) for language, letters in _LATIN_LANGUAGES.items()}


_NON_ASCII_RUN = re.compile("[^\x00-\x7f]+")
WORD_CHARS = 64  # how far _word_sample looks from a non-ASCII run for the start and end of its word


def scored_sample(text: str) -> str:
    """What of a decoding :func:`plausibility` scores: each run of non-ASCII characters with the
    character before and after it (all that score reads: a non-ASCII character, its neighbours,
    and whether two CJK characters touch), the runs joined by newlines, so the score is the whole
    text's. Where they pass :data:`SAMPLE_CHARS`, the runs of :data:`SAMPLE_WINDOWS` stretches
    spread evenly over the text, up to an equal share each. (Windows over the text itself, each
    starting at its stretch's first non-ASCII character, saw only a curly quote where Chinese
    names came later, and a GBK file with a few names was read as Big5.) Runs are read only as far
    as the sample needs: a French file has one every few words. The same text always gives the
    same sample."""
    every = _runs(text, 0, len(text), SAMPLE_CHARS, whole=True)
    if every is not None:
        return every
    share, stretch = SAMPLE_CHARS // SAMPLE_WINDOWS, len(text) // SAMPLE_WINDOWS
    ends = [stretch * k for k in range(1, SAMPLE_WINDOWS)] + [len(text)]
    return "\n".join(_runs(text, end - stretch, end, share, whole=False) or "" for end in ends)


def _runs(text: str, start: int, end: int, most: int, whole: bool) -> str | None:
    """The non-ASCII runs found in ``text[start:end]`` with their neighbours, one a line, at most
    ``most`` characters: where more are there, None (``whole``) or the first ``most``."""
    pieces, room = [], most
    for run in _NON_ASCII_RUN.finditer(text, start, end):
        begin, stop = max(run.start() - 1, 0), run.end() + 1
        if stop - begin > room:
            if whole:
                return None
            pieces.append(text[begin : begin + room])
            break
        pieces.append(text[begin:stop])
        room -= stop - begin + 1
    return "\n".join(pieces)


def _word_sample(text: str) -> str:
    """The words of ``text`` that hold a non-ASCII character, with the character before and after
    each, one a line, up to :data:`SAMPLE_CHARS`: what :func:`_by_language` scores (whether a letter
    is in a capitalised word needs the whole word, which :func:`scored_sample` does not keep)."""
    pieces, room, end = [], SAMPLE_CHARS, 0
    for run in _NON_ASCII_RUN.finditer(text):
        if run.start() < end:  # in the word taken already
            continue
        begin, end = run.start(), run.end()
        while begin > max(run.start() - WORD_CHARS, 0) and not text[begin - 1].isspace():
            begin -= 1
        while end < min(run.end() + WORD_CHARS, len(text)) and not text[end].isspace():
            end += 1
        begin, end = max(begin - 1, 0), end + 1
        if end - begin > room:
            break
        pieces.append(text[begin:end])
        room -= end - begin + 1
    return "\n".join(pieces)


@dataclass(frozen=True)
class Guess:
    text: str
    encoding: str


def _read(data: bytes, encoding: str) -> str:
    """``data`` decoded (strictly), less a leading GB18030 or UTF-7 signature (U+FEFF), as
    charset-normalizer reads its candidates."""
    return data.decode(encoding).removeprefix("\ufeff")


@dataclass(frozen=True)
class _Scored:
    """An encoding ``data`` decodes in, and the plausibility of its decoding. The decoded text is
    not kept: holding every candidate's (17 for a French file) took ~20x the file's size."""

    encoding: str
    score: float


def _score(data: bytes, encoding: str) -> _Scored | None:
    try:
        text = _read(data, encoding)
    except UnicodeDecodeError:
        return None
    return _Scored(encoding, plausibility(scored_sample(text)))


def _candidates(data: bytes) -> list[_Scored]:
    """charset-normalizer's candidates in its order, then the :data:`FALLBACKS` it did not list."""
    from charset_normalizer import from_bytes

    encodings = []
    for match in from_bytes(data):
        # UTF-16/32 without a byte order mark is what it guesses for short texts it cannot place
        if not match.encoding.startswith(("utf_16", "utf_32")) and match.encoding not in _NEVER_TEXT:
            encodings.append(match.encoding)
    encodings += [e for e in FALLBACKS if e not in encodings]
    return [scored for scored in (_score(data, e) for e in encodings) if scored is not None]


def _utf16_readings(data: bytes) -> list[_Scored]:
    """``data`` read as UTF-16-LE and -BE without a byte order mark, where it decodes (even length,
    surrogates paired). Only a last resort (see :func:`detect_legacy`): ASCII pairs read as UTF-16
    are Chinese characters ("Bush hid the facts"), and GBK's common characters read as UTF-16-BE
    are Hangul syllables, so a legacy decoding that reads as plausible comes first."""
    if len(data) % 2:
        return []
    return [scored for scored in (_score(data, e) for e in ("utf-16-le", "utf-16-be")) if scored is not None]


def _best(guesses: list[_Scored], among: list[int] | None = None) -> int:
    """The index of the best-scoring guess (of those ``among``, if given; 0 if none); ties go to
    the earliest (charset-normalizer's order)."""
    return max(range(len(guesses)) if among is None else among, key=lambda i: (guesses[i].score, -i), default=0)


def detect_legacy(data: bytes) -> Guess | None:
    """The decoding of ``data`` (not UTF-8) most likely meant: charset-normalizer's first guess
    unless it reads as implausible text (then the best-scoring decoding) or a fallback (GB18030,
    cp1252) scores clearly higher (then that one); where none reads as plausible, UTF-16 without
    a byte order mark if that does, else the best-scoring decoding still."""
    chosen = _choose(data)
    return Guess(_read(data, chosen), chosen) if chosen is not None else None


def _by_language(data: bytes, guesses: list[_Scored], chosen: _Scored) -> str:
    """``chosen``'s encoding, unless it is cp1252 and a decoding with Latin Extended letters that
    charset-normalizer ranks above cp1252 (any, where it did not name cp1252) scores higher by
    language (``plausibility(by_language=True)``, on :func:`_word_sample`; the highest, the earliest
    of equals)."""
    if chosen.encoding != "cp1252":
        return chosen.encoding
    best, best_score = chosen.encoding, None
    for guess in guesses[: guesses.index(chosen)]:
        sample = _word_sample(_read(data, guess.encoding))
        if any(map(_latin_extended, sample)):
            if best_score is None:
                best_score = plausibility(_word_sample(_read(data, chosen.encoding)), by_language=True)
            score = plausibility(sample, by_language=True)
            if score > best_score:
                best, best_score = guess.encoding, score
    return best


def _choose(data: bytes) -> str | None:
    """The encoding :func:`detect_legacy` reads ``data`` in."""
    guesses = _candidates(data)
    if guesses:
        first = guesses[0].score
        if first >= PLAUSIBLE:
            # it gives way only to a fallback (GB18030, cp1252) scoring clearly higher: between
            # charset-normalizer's own candidates its order knows more than our scores (EUC-KR
            # with bullets read as EUC-JIS kanji scored higher than the Hangul it was)
            fallback = guesses[_best(guesses, [i for i, g in enumerate(guesses) if g.encoding in FALLBACKS])]
            if fallback.score - first < MARGIN:
                return guesses[0].encoding
            return _by_language(data, guesses, fallback)
        best = guesses[_best(guesses)]
        if best.score >= PLAUSIBLE:
            return _by_language(data, guesses, best)
    readings = _utf16_readings(data)
    if readings and max(r.score for r in readings) >= PLAUSIBLE:
        return readings[_best(readings)].encoding
    return _by_language(data, guesses, guesses[_best(guesses)]) if guesses else None
