"""Parse a model file into the typed AST of ``unroller.compiler.ast``.

The grammar lives in ``grammars/model.lark`` (LALR, contextual lexer). Lark's parse tree
is walked once by ``_Builder``, which fills every ``Loc`` and makes the checks that
belong to the syntax: dtypes, dims, duplicate block parameters, argument order, the
place of ``return``, one model per file, string escapes and dotted names. Names, ops
and shapes are not resolved here: that is the graph builder's job.

Every problem is raised as a ``ModelError`` with the location of the offending text;
Lark's exceptions never escape, and its internal terminal names never reach a message.
Hostile text is refused before it can cost much: a file over ``MAX_SOURCE_BYTES``, a
byte that is not UTF-8, a control or bidirectional-override character, an integer that
does not fit in 64 bits (checked by its length before any conversion), a float that
overflows or underflows, and tuples nested deeper than ``MAX_TUPLE_DEPTH``.
"""

from __future__ import annotations

import functools
import math
import re
import unicodedata
from collections.abc import Iterable
from pathlib import Path

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from unroller.compiler.ast import (
    BinOp,
    Block,
    BlockParam,
    Call,
    Const,
    Expr,
    KwArg,
    Loc,
    ModelAST,
    Ref,
    Return,
    TensorDecl,
    TupleExpr,
)
from unroller.compiler.dtypes import DTYPES
from unroller.compiler.shapes import MAX_DIM
from unroller.errors import ModelError, closest
from unroller.files import FileTooLarge, NotRegularFile, file_kind, read_bounded
from unroller.resources import resource_dir

__all__ = [
    "DTYPES",
    "MAX_INT",
    "MAX_SOURCE_BYTES",
    "MAX_TUPLE_DEPTH",
    "parse",
    "parse_file",
    "read_source",
]


#: The largest model file (and model text) accepted, in bytes (characters for text): a
#: real model is a few KiB, and 1 MiB already holds more statements than MAX_NODES.
MAX_SOURCE_BYTES = 1024 * 1024
#: The largest integer literal: every integer must fit in a signed 64-bit integer.
MAX_INT = 2**63 - 1
#: How deeply tuples may nest in a keyword value (no operator takes a nested tuple).
MAX_TUPLE_DEPTH = 16
#: How deep integer arithmetic may nest in one keyword value (``a + b + ...`` terms).
MAX_EXPR_DEPTH = 32

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_INTEGER = re.compile(r"(0|[1-9][0-9]*)\Z")
_BOM = "\ufeff"
# Characters refused anywhere in a model file, even in comments and strings: C0 and C1
# controls other than tab, line feed, carriage return and form feed; DEL; line and
# paragraph separators; the bidirectional controls that can make text display in an
# order other than the one it is read in ("Trojan Source"); lone surrogates.
_FORBIDDEN = re.compile(
    "[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029"
    "\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


@functools.lru_cache(maxsize=1)
def _lark() -> Lark:
    grammar = (resource_dir("grammars") / "model.lark").read_text(encoding="utf-8")
    return Lark(
        grammar,
        parser="lalr",
        lexer="contextual",
        propagate_positions=True,
        maybe_placeholders=True,
    )


def parse(source: str, filename: str = "<string>") -> ModelAST:
    """Parse the text of a model file; raise ``ModelError`` on any mistake in it.

    A leading byte-order mark is ignored (columns count from after it)."""
    if source.startswith(_BOM):
        source = source[1:]
    _check_text(source)
    try:
        tree = _lark().parse(source)
    except UnexpectedInput as exc:
        raise _syntax_error(exc, source) from None
    model = _Builder().build(tree)
    model.filename = filename
    model.source = source
    return model


def read_source(path: str | Path) -> str:
    """The text of a model file: a regular file of at most ``MAX_SOURCE_BYTES`` bytes of
    UTF-8 (a leading byte-order mark is dropped). A file that is missing, not a regular
    file (a directory, a FIFO, a device: reading one could block or never end), too large
    or not UTF-8 is a ``ModelError``; a bad byte is reported at its line and column. The
    bounded reading is ``unroller.files.read_bounded``'s; the words are the model file's."""
    try:
        data = read_bounded(path, MAX_SOURCE_BYTES, "the model file")
    except NotRegularFile as exc:
        kind = file_kind(exc.mode, model_words=True)
        raise ModelError(f"the model file is {kind}, not a regular file") from None
    except FileTooLarge as exc:
        raise ModelError(_too_large(exc.limit + 1 if exc.size is None else exc.size)) from None
    except FileNotFoundError:
        raise ModelError("no such model file") from None
    except OSError as exc:
        raise ModelError(f"cannot read the model file: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise _decode_error(data, exc) from None


def parse_file(path: str | Path) -> ModelAST:
    """Read a UTF-8 model file (a leading byte-order mark is ignored) and parse it."""
    return parse(read_source(path), filename=str(path))


def _too_large(size: int) -> str:
    return (
        f"the model file is too large ({size:,} bytes; the limit is "
        f"{MAX_SOURCE_BYTES // (1024 * 1024)} MiB)"
    )


def _decode_error(data: bytes, exc: UnicodeDecodeError) -> ModelError:
    # The utf-8-sig codec reports positions in the bytes after the byte-order mark.
    data, start = bytes(exc.object), exc.start
    before = data[:start]
    line = before.count(b"\n") + 1
    line_start = before.rfind(b"\n") + 1
    col = len(before[line_start:].decode("utf-8", errors="replace")) + 1
    return ModelError(
        f"the file is not valid UTF-8 (byte 0x{data[start]:02x})",
        Loc(line, col, 1),
        "save the file as UTF-8",
    )


def _loc_at(source: str, pos: int, length: int = 1) -> Loc:
    """The line and column of the character at ``pos``."""
    line = source.count("\n", 0, pos) + 1
    return Loc(line, pos - (source.rfind("\n", 0, pos) + 1) + 1, length)


def _check_text(source: str) -> None:
    """Refuse text too large to parse, and characters no model file may hold."""
    if len(source) > MAX_SOURCE_BYTES:
        raise ModelError(
            f"the model text is too large ({len(source):,} characters; the limit is "
            f"{MAX_SOURCE_BYTES:,})",
            _loc_at(source, MAX_SOURCE_BYTES),
        )
    bad = _FORBIDDEN.search(source)
    if bad is None:
        return
    ch = bad.group()
    code = f"U+{ord(ch):04X}"
    if ch in _BIDI:
        what = (
            f"bidirectional control character {code} (it can make the text display in "
            "another order than it is read)"
        )
    elif ch in "\u2028\u2029":
        what = f"line or paragraph separator {code} (end lines with a line feed)"
    elif 0xD800 <= ord(ch) <= 0xDFFF:
        what = f"lone surrogate {code} (not a character)"
    else:
        what = f"control character {code}"
    raise ModelError(f"{what} is not allowed in a model file", _loc_at(source, bad.start()))


# --------------------------------------------------------------------------------------
# Syntax errors: Lark's exceptions in words a user understands
# --------------------------------------------------------------------------------------

# Descriptions of the terminals that are patterns; string terminals are shown quoted.
_PATTERN_WORDS = {
    "NAME": "a name",
    "INT": "an integer",
    "FLOAT": "a number",
    "STRING": "a string",
    "$END": "end of file",
}
# The order in which expected punctuation and keywords are listed.
_ORDER = (
    "MODEL",
    "INPUT",
    "TARGET",
    "BLOCK",
    "RETURN",
    "TRUE",
    "FALSE",
    "COLON",
    "LSQB",
    "LPAR",
    "LBRACE",
    "COMMA",
    "RPAR",
    "RSQB",
    "RBRACE",
    "EQUAL",
    "$END",
)
_VALUE_START = frozenset({"INT", "FLOAT", "STRING", "TRUE", "FALSE", "NAME", "LPAR"})
_ITEM_START = frozenset({"INPUT", "TARGET", "BLOCK", "RETURN", "NAME"})
_CLOSERS = frozenset({"RPAR", "RSQB", "RBRACE"})
_VALUE_WORDS = "a value (a number, a string, true, false, a tuple or a block parameter name)"
_DTYPE_WORDS = "a dtype (" + ", ".join(DTYPES[:-1]) + " or " + DTYPES[-1] + ")"


@functools.lru_cache(maxsize=1)
def _literal_words() -> dict[str, str]:
    """Terminal name -> the quoted text, for every terminal that is a fixed string."""
    return {t.name: f"'{t.pattern.value}'" for t in _lark().terminals if t.pattern.type == "str"}


def _terminal_words(name: str) -> str | None:
    return _PATTERN_WORDS.get(name) or _literal_words().get(name)


def _join(words: list[str]) -> str:
    if len(words) <= 1:
        return "".join(words)
    return ", ".join(words[:-1]) + " or " + words[-1]


def _short(text: str, limit: int = 30) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe_token(tok: Token) -> str:
    if tok.type == "$END":
        return "end of file"
    if tok.type == "NAME":
        return f"name '{_short(tok.value)}'"
    if tok.type in ("INT", "FLOAT") or (tok.type == "INDEX_NAME" and tok.value.isdigit()):
        return f"number '{_short(tok.value)}'"
    if tok.type == "INDEX_NAME":
        return f"name '{_short(tok.value)}'"
    if tok.type == "STRING":
        return f"string {_short(tok.value)}"
    return f"'{_short(tok.value)}'"


def _describe_char(ch: str) -> str:
    return f"'{ch}'" if ch.isprintable() else repr(ch)


def _is(value: object, *types: str) -> bool:
    return isinstance(value, Token) and value.type in types


def _context(stack: list) -> str:
    """What the parser is in the middle of, judged from its value stack."""
    if not stack:
        return "file"
    last = stack[-1]
    if isinstance(last, Tree) and last.data == "decl_kind":
        return f"decl:{last.children[0].value}"
    if _is(last, "MODEL"):
        return "model_name"
    if _is(last, "INPUT", "TARGET"):
        return f"decl:{last.value}"
    if _is(last, "BLOCK"):
        return "block_name"
    if _is(last, "COLON"):
        return "dtype"
    if _is(last, "EQUAL"):
        before = stack[-2] if len(stack) >= 2 else None
        return "op" if isinstance(before, Tree) and before.data == "target" else "value"
    for i in range(len(stack) - 1, -1, -1):
        item = stack[i]
        if _is(item, "LSQB"):
            return "dims"
        if _is(item, "RETURN"):
            return "return"
        if _is(item, "LBRACE"):
            return "body"
        if _is(item, "LPAR"):
            before = stack[i - 1] if i >= 1 else None
            if _is(before, "NAME"):
                return "params" if i >= 2 and _is(stack[i - 2], "BLOCK") else "args"
            return "tuple"
    return "file"


_NAME_WORDS = {
    "model_name": ["the model's name"],
    "decl:input": ["the input's name"],
    "decl:target": ["the target's name"],
    "block_name": ["the block's name"],
    "dtype": [_DTYPE_WORDS],
    "op": ["an operator or block name"],
    "args": ["a value name", "a keyword argument"],
    "params": ["a parameter name"],
    "return": ["a value name"],
}


_ARITHMETIC = {"PLUS", "MINUS", "STAR", "DSLASH"}


def _expected_words(expected: Iterable[str], stack: list, at_end: bool) -> str:
    """``expected ...`` in words, from the terminals the parser would have accepted."""
    exp = set(expected)
    if at_end and exp & _CLOSERS:
        exp &= _CLOSERS  # at the end of the file, what is missing is a closing bracket
    ctx = _context(stack)
    if exp == {"MODEL", "$END"}:
        exp = {"$END"}  # after the model: a second one is an error anyway
    if exp - _ARITHMETIC:
        exp -= _ARITHMETIC  # `k + 1` is possible after any value, but rarely what is missing
    words: list[str] = []
    if {"INT", "STRING"} <= exp:
        words.append(_VALUE_WORDS)
        exp -= _VALUE_START
    if ctx == "dims" and "INT" in exp:
        words.append("N or a positive integer")
        exp -= {"NAME", "INT", "FLOAT"}
    if _ITEM_START <= exp:
        words += ["a statement", "'input'", "'target'", "'block'", "'return'"]
        exp -= _ITEM_START
    if "NAME" in exp:
        words += _NAME_WORDS.get(ctx, ["a name"])
        exp.discard("NAME")
        if ctx.startswith("decl:") or ctx in ("block_name", "return"):
            exp.discard("EQUAL")  # `input = ...` is a statement too, but rarely meant
    for name in _ORDER:
        if name in exp:
            exp.discard(name)
            word = _terminal_words(name)
            if word:
                words.append(word)
    # Anything left (there should be nothing) is shown only if it has a friendly name.
    words += sorted(w for w in map(_terminal_words, exp) if w)
    return f" (expected {_join(words)})" if words else ""


def _accepted(exc: UnexpectedInput) -> tuple[set[str], list]:
    parser = getattr(exc, "interactive_parser", None)
    if parser is not None:
        try:
            return set(parser.accepts()), list(parser.parser_state.value_stack)
        except Exception:  # pragma: no cover - fall back to what the exception says
            pass
    expected = getattr(exc, "expected", None) or getattr(exc, "allowed", None) or ()
    return set(expected), []


def _syntax_error(exc: UnexpectedInput, source: str) -> ModelError:
    expected, stack = _accepted(exc)
    if isinstance(exc, UnexpectedToken):
        tok = exc.token
        if tok.type == "$END":
            line = tok.end_line or tok.line or 1
            col = tok.end_column or tok.column or 1
            where = _expected_words(expected, stack, at_end=True)
            return ModelError(f"unexpected end of file{where}", Loc(line, col, 1))
        loc = Loc(tok.line, tok.column, max(1, len(tok.value)))
        hint = None
        ctx = _context(stack)
        if ctx == "args" and tok.type in ("INT", "FLOAT", "STRING"):
            hint = "positional arguments are value names; give constants as key=value"
        elif expected <= {"EQUAL"} and stack and _is(stack[-1], "NAME"):
            # `retrun x`, `Input x: ...`: a misspelt keyword was read as a statement's target
            best = closest(stack[-1].value.lower(), ["input", "target", "block", "return"])
            if best:
                hint = f"did you mean '{best}' instead of '{stack[-1]}'?"
        elif tok.type == "NAME":
            keywords = [
                _literal_words()[t][1:-1] for t in expected if t in _literal_words() and t != "$END"
            ]
            best = closest(tok.value, [k for k in keywords if k.isalpha()])
            if best:
                hint = f"did you mean '{best}'?"
        where = _expected_words(expected, stack, at_end=False)
        return ModelError(f"unexpected {_describe_token(tok)}{where}", loc, hint)
    if isinstance(exc, UnexpectedCharacters):
        pos = exc.pos_in_stream
        ch = source[pos] if 0 <= pos < len(source) else ""
        if ch == '"':
            rest = source[pos:].split("\n", 1)[0].rstrip("\r")
            return ModelError(
                "unterminated string (a string must end with '\"' on the same line)",
                Loc(exc.line, exc.column, max(1, len(rest))),
            )
        where = _expected_words(expected, stack, at_end=False)
        return ModelError(
            f"unexpected character {_describe_char(ch)}{where}", Loc(exc.line, exc.column, 1)
        )
    line, col = getattr(exc, "line", None), getattr(exc, "column", None)  # pragma: no cover
    return ModelError("syntax error", Loc(line, col) if line and col else None)  # pragma: no cover


# --------------------------------------------------------------------------------------
# The AST builder
# --------------------------------------------------------------------------------------


def _tok_loc(tok: Token) -> Loc:
    return Loc(tok.line, tok.column, max(1, len(tok.value)))


def _int_token(tok: Token) -> int:
    """The value of an INT token, which must fit in a signed 64-bit integer. The digits
    are counted before any conversion, so a 5,000-digit literal costs nothing."""
    sign = "-" if tok.value.startswith("-") else ""
    digits = tok.value.lstrip("+-").lstrip("0")
    if len(digits) > len(str(MAX_INT)) or abs(number := int(sign + (digits or "0"))) > MAX_INT:
        shown = tok.value if len(tok.value) <= 24 else f"{tok.value[:12]}...({len(digits)} digits)"
        raise ModelError(
            f"integer {shown} is too large (an integer must fit in 64 bits: at most "
            f"{MAX_INT:,} in magnitude)",
            _tok_loc(tok),
        )
    return number


def _float_token(tok: Token) -> float:
    """The value of a FLOAT token: finite, and not a nonzero literal that rounds to 0."""
    shown = _short(tok.value)
    number = float(tok.value)
    if not math.isfinite(number):
        raise ModelError(f"number '{shown}' is too large for a float", _tok_loc(tok))
    if number == 0 and any(c in "123456789" for c in tok.value.lower().partition("e")[0]):
        raise ModelError(
            f"number '{shown}' is too small for a float (it would round to 0)", _tok_loc(tok)
        )
    return number


def _tree_loc(tree: Tree) -> Loc:
    meta = tree.meta
    if meta.end_line == meta.line:
        length = meta.end_column - meta.column
    else:
        length = 1
    return Loc(meta.line, meta.column, max(1, length))


_SIMPLE_ESCAPES = {
    "\\": "\\",
    '"': '"',
    "'": "'",
    "n": "\n",
    "t": "\t",
    "r": "\r",
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "v": "\v",
}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
_OCTAL = "01234567"
_HEX = "0123456789abcdefABCDEF"


def _decode_string(tok: Token) -> str:
    """The value of a double-quoted literal, with Python's escapes; unknown ones fail."""
    text = tok.value
    out: list[str] = []
    i = 1
    end = len(text) - 1  # the closing quote
    while i < end:
        ch = text[i]
        if ch != "\\":
            out.append(ch)
            i += 1
            continue
        kind = text[i + 1]  # the regex guarantees a character after a backslash

        def fail(message: str, length: int, at: int = i) -> ModelError:
            return ModelError(message, Loc(tok.line, tok.column + at, max(1, length)))

        if kind in _SIMPLE_ESCAPES:
            out.append(_SIMPLE_ESCAPES[kind])
            i += 2
        elif kind in _OCTAL:
            j = i + 1
            while j < end and j < i + 4 and text[j] in _OCTAL:
                j += 1
            out.append(chr(int(text[i + 1 : j], 8)))
            i = j
        elif kind in _HEX_ESCAPES:
            width = _HEX_ESCAPES[kind]
            digits = text[i + 2 : i + 2 + width]
            if len(digits) < width or not all(c in _HEX for c in digits) or i + 2 + width > end:
                raise fail(
                    f"bad escape '\\{kind}' in string (expected {width} hex digits after it)", 2
                )
            code = int(digits, 16)
            if code > 0x10FFFF:
                raise fail(f"'\\{kind}{digits}' is not a Unicode character", 2 + width)
            if 0xD800 <= code <= 0xDFFF:
                raise fail(f"'\\{kind}{digits}' is a surrogate, not a character", 2 + width)
            out.append(chr(code))
            i += 2 + width
        elif kind == "N":
            close = text.find("}", i, end)
            if text[i + 2 : i + 3] != "{" or close < 0:
                raise fail(
                    "bad escape '\\N' in string "
                    "(expected '\\N{...}' with a Unicode character name)",
                    2,
                )
            char_name = text[i + 3 : close]
            try:
                out.append(unicodedata.lookup(char_name))
            except KeyError:
                raise fail(
                    f"unknown character name '{char_name}' in string", close + 1 - i
                ) from None
            i = close + 1
        else:
            raise fail(
                f"unknown escape '\\{kind}' in string (use \\\\ for a backslash; known escapes:"
                ' \\" \\\\ \\n \\t \\r \\xhh \\uhhhh ...)',
                2,
            )
    return "".join(out)


class _Builder:
    """Walks Lark's parse tree and builds the ``ModelAST``."""

    def build(self, tree: Tree) -> ModelAST:
        models = tree.children
        if len(models) > 1:
            first_name = models[0].children[1]
            second_kw = models[1].children[0]
            raise ModelError(
                f"only one model per file (model '{first_name}' is already defined at "
                f"line {first_name.line})",
                _tok_loc(second_kw),
            )
        return self.model(models[0])

    # ---- names -------------------------------------------------------------------

    def plain(self, tok: Token, what: str) -> str:
        """A name that must be a single identifier (no dotted path)."""
        if "." in tok.value:
            raise ModelError(
                f"{what} must be a plain name, not a dotted path '{tok}'", _tok_loc(tok)
            )
        return tok.value

    def path(self, tok: Token) -> str:
        """A value name: an identifier, or a dotted path of identifiers and integers."""
        name = tok.value
        offset = 0
        leading_index = tok.type == "INDEX_NAME"
        for index, part in enumerate(name.split(".")):
            if (index or leading_index) and not (_IDENT.match(part) or _INTEGER.match(part)):
                if part.isdigit():
                    why = "an integer part has no leading zeros"
                else:
                    why = "each part after a '.' is a name or an integer"
                raise ModelError(
                    f"invalid value name '{name}': '{part}' ({why})",
                    Loc(tok.line, tok.column + offset, len(part)),
                )
            offset += len(part) + 1
        return name

    def ref(self, tok: Token) -> Ref:
        return Ref(self.path(tok), _tok_loc(tok))

    # ---- model and bodies ----------------------------------------------------------

    def model(self, tree: Tree) -> ModelAST:
        _kw, name_tok, *items, close = tree.children
        name = self.plain(name_tok, "the model's name")
        decls: list[TensorDecl] = []
        blocks: list[Block] = []
        stmts: list[Call] = []
        ret = self.body(items, close, f"model '{name}'", decls, blocks, stmts)
        return ModelAST(
            name=name,
            decls=decls,
            blocks=blocks,
            stmts=stmts,
            ret=ret,
            loc=_tok_loc(name_tok),
        )

    def body(
        self,
        items: list[Tree],
        close: Token,
        owner: str,
        decls: list[TensorDecl] | None,
        blocks: list[Block] | None,
        stmts: list[Call],
    ) -> Return:
        """Fill the lists from a model's or block's items; the lists that are None are
        not allowed in this body. Returns the body's single, final ``return``."""
        ret: Return | None = None
        for item in items:
            if ret is not None:
                if item.data == "ret":
                    raise ModelError(
                        f"more than one 'return' in {owner} (the first is at line {ret.loc.line})",
                        _tok_loc(item.children[0]),
                    )
                raise ModelError(
                    f"{_ITEM_WORDS[item.data]} after 'return' in {owner} (the 'return' at "
                    f"line {ret.loc.line} must come last)",
                    self.item_loc(item),
                )
            if item.data == "decl":
                if decls is None:
                    raise ModelError(
                        f"'{item.children[0].children[0]}' declarations belong in the model, "
                        f"not in {owner}",
                        _tok_loc(item.children[0].children[0]),
                    )
                decls.append(self.decl(item))
            elif item.data == "block_def":
                if blocks is None:
                    raise ModelError(
                        f"blocks cannot be nested: define it outside {owner}",
                        _tok_loc(item.children[0]),
                    )
                blocks.append(self.block(item))
            elif item.data == "stmt":
                stmts.append(self.stmt(item))
            else:
                ret = self.ret(item)
        if ret is None:
            form = "return VALUE" if owner.startswith("block") else "return LOSS[, PRED...]"
            raise ModelError(
                f"{owner} has no 'return' (expected '{form}' before this '}}')", _tok_loc(close)
            )
        return ret

    def item_loc(self, item: Tree) -> Loc:
        first = item.children[0]
        if isinstance(first, Tree):  # decl_kind or target
            first = first.children[0]
        return _tok_loc(first)

    # ---- declarations ----------------------------------------------------------------

    def decl(self, tree: Tree) -> TensorDecl:
        kind_tree, name_tok, dtype_tok, open_tok, *dim_items = tree.children
        kind = kind_tree.children[0].value
        name = self.plain(name_tok, f"the {kind}'s name")
        dtype = dtype_tok.value
        if dtype not in DTYPES:
            best = closest(dtype, DTYPES)
            raise ModelError(
                f"unknown dtype '{dtype}' (expected one of {', '.join(DTYPES)})",
                _tok_loc(dtype_tok),
                f"did you mean '{best}'?" if best else None,
            )
        dim_toks = [d for d in dim_items if d is not None]
        if not dim_toks:
            raise ModelError(
                "the first dim must be N (the batch dimension); the dims are empty",
                _tok_loc(open_tok),
            )
        dims: list[str | int] = []
        for index, tok in enumerate(dim_toks):
            if index == 0:
                if tok.value != "N":
                    raise ModelError(
                        f"the first dim must be N (the batch dimension), got '{tok}'",
                        _tok_loc(tok),
                    )
                dims.append("N")
            elif tok.type == "INT" and (size := _int_token(tok)) > 0:
                if size > MAX_DIM:
                    raise ModelError(
                        f"dim {size} is too large (a dim is at most {MAX_DIM:,})", _tok_loc(tok)
                    )
                dims.append(size)
            elif tok.value == "N":
                raise ModelError(
                    "only the first dim is N; the other dims must be positive integers",
                    _tok_loc(tok),
                )
            else:
                raise ModelError(f"a dim must be a positive integer, got '{tok}'", _tok_loc(tok))
        return TensorDecl(
            kind=kind,
            name=name,
            dtype=dtype,
            dims=tuple(dims),
            loc=_tok_loc(name_tok),
            dtype_loc=_tok_loc(dtype_tok),
            dims_loc=tuple(_tok_loc(t) for t in dim_toks),
        )

    # ---- blocks ------------------------------------------------------------------------

    def block(self, tree: Tree) -> Block:
        _kw, name_tok, *rest = tree.children
        name = self.plain(name_tok, "a block's name")
        params: list[BlockParam] = []
        seen: dict[str, Loc] = {}
        index = 0
        while index < len(rest) and (
            rest[index] is None or isinstance(rest[index], Tree) and rest[index].data == "param"
        ):
            param = rest[index]
            index += 1
            if param is None:
                continue
            ptok, default = param.children
            pname = self.plain(ptok, "a parameter name")
            loc = _tok_loc(ptok)
            if pname in seen:
                raise ModelError(
                    f"duplicate parameter '{pname}' in block '{name}' (first at line "
                    f"{seen[pname].line}, column {seen[pname].col})",
                    loc,
                )
            seen[pname] = loc
            params.append(BlockParam(pname, None if default is None else self.value(default), loc))
        *items, close = rest[index:]
        body: list[Call] = []
        ret = self.body(items, close, f"block '{name}'", None, None, body)
        if len(ret.values) != 1:
            raise ModelError(
                f"a block returns exactly one value; block '{name}' returns {len(ret.values)}",
                ret.values[1].loc,
            )
        return Block(name, tuple(params), tuple(body), ret.values[0], _tok_loc(name_tok))

    # ---- statements ----------------------------------------------------------------------

    def stmt(self, tree: Tree) -> Call:
        target_tree, op_tok, *arg_trees = tree.children
        target_tok = target_tree.children[0]
        target = self.path(target_tok)
        op = self.plain(op_tok, "an operator or block name")
        args: list[Ref] = []
        kwargs: list[KwArg] = []
        seen: dict[str, KwArg] = {}
        for arg in arg_trees:
            if arg is None:
                continue
            if arg.data == "pos_arg":
                if kwargs:
                    raise ModelError(
                        f"positional argument '{arg.children[0]}' after keyword arguments "
                        "(positional value names come first)",
                        _tok_loc(arg.children[0]),
                    )
                args.append(self.ref(arg.children[0]))
                continue
            key_tok, value = arg.children
            key = self.plain(key_tok, "a keyword argument's name")
            if key in seen:
                raise ModelError(
                    f"keyword argument '{key}' given twice (first at column {seen[key].loc.col})",
                    _tok_loc(key_tok),
                )
            kwarg = KwArg(key, self.value(value), _tok_loc(key_tok))
            seen[key] = kwarg
            kwargs.append(kwarg)
        return Call(
            target=target,
            op=op,
            args=tuple(args),
            kwargs=tuple(kwargs),
            loc=_tok_loc(target_tok),
            op_loc=_tok_loc(op_tok),
        )

    def ret(self, tree: Tree) -> Return:
        kw, *names = tree.children
        return Return(tuple(self.ref(tok) for tok in names), _tok_loc(kw))

    # ---- keyword values ------------------------------------------------------------------

    def value(self, node: Tree | Token, depth: int = 0) -> Expr:
        if isinstance(node, Token):
            loc = _tok_loc(node)
            if node.type == "INT":
                return Const(_int_token(node), loc)
            if node.type == "FLOAT":
                return Const(_float_token(node), loc)
            if node.type == "STRING":
                return Const(_decode_string(node), loc)
            if node.type in ("TRUE", "FALSE"):
                return Const(node.type == "TRUE", loc)
            raise AssertionError(f"unexpected token {node!r}")  # pragma: no cover
        loc = _tree_loc(node)
        if node.data == "ref":
            tok = node.children[0]
            if "." in tok.value:
                raise ModelError(
                    f"a keyword value is a constant or a block parameter, not the value "
                    f"name '{tok}'",
                    _tok_loc(tok),
                )
            return Ref(tok.value, _tok_loc(tok))
        if node.data in ("binop", "neg") and depth >= MAX_EXPR_DEPTH:
            raise ModelError(
                f"arithmetic nested more than {MAX_EXPR_DEPTH} deep in a keyword value",
                Loc(loc.line, loc.col, 1),
            )
        if node.data == "binop":
            left, op, right = node.children
            return BinOp(
                op.value,
                self.value(left, depth + 1),
                self.value(right, depth + 1),
                _tok_loc(op),
            )
        if node.data == "neg":
            sign, operand = node.children
            return BinOp("neg", None, self.value(operand, depth + 1), _tok_loc(sign))
        if node.data == "paren_value":
            inner = node.children[1]
            if isinstance(inner, Tree) and inner.data in ("binop", "neg"):
                return self.value(inner, depth + 1)
            raise ModelError(
                "parentheses around a single value: write (v,) for a 1-tuple, or drop them",
                loc,
            )
        if depth >= MAX_TUPLE_DEPTH:
            raise ModelError(
                f"tuples nested more than {MAX_TUPLE_DEPTH} deep (no argument takes a "
                "nested tuple)",
                Loc(loc.line, loc.col, 1),
            )
        items = tuple(self.value(child, depth + 1) for child in node.children[1:])
        if all(isinstance(item, Const) for item in items):
            return Const(tuple(item.value for item in items), loc)
        return TupleExpr(items, loc)


_ITEM_WORDS = {
    "decl": "a declaration",
    "block_def": "a block",
    "stmt": "a statement",
}
