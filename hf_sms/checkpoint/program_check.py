"""A ``torch.export`` archive (``model.pt2``) checked before ``torch.export.load`` reads it.

``torch.export.load`` unpickles some entries of an archive (a weight or constant marked ``use_pickle``, a legacy
``data/weights/model.pt``, the sample inputs, custom and opaque objects) and loads AOTInductor libraries; it parses
every symbolic size (``expr_str``) with ``sympy.sympify``, which evaluates Python; it imports modules named in a
pytree spec's ``__enum__`` or ``defaultdict`` entries; and it pastes input names, dict keys and attribute targets
into the Python source of the module it builds. So a crafted file runs code (torch's own docstring: never load
untrusted data). hf-sms writes programs that hold none of that (no sample inputs either:
:mod:`hf_sms.checkpoint.plain`), and :func:`check_program`, which the model card gives word for word (the standard
library only: no hf-sms), refuses any archive that holds anything else: every string torch evaluates, imports or
writes into code is held to the grammar torch's own writer produces.
"""

import ast
import json
import re
import zipfile


def check_program(path):
    """Raise ValueError unless the torch.export archive at path holds only a program: its JSON and raw tensors, with
    nothing in the JSON that torch would evaluate, import or write into code beyond the forms its own writer uses."""

    def refuse(what):
        raise ValueError(f"{path} {what}, which torch.export.load would run as code: do not load it")

    plain = re.compile(
        r"archive_format|archive_version|byteorder|\.data/(version|serialization_id)|models/model\.json"
        r"|data/weights/model_weights_config\.json|data/constants/model_constants_config\.json"
        r"|data/weights/weight_\d+|data/constants/tensor_\d+|data/sample_inputs/model\.pt"
    )
    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
        names = [info.filename for info in infos]
        if len({name.split("/")[0] for name in names}) != 1 or len(set(names)) != len(names):
            raise ValueError(f"{path} is not one torch.export archive: do not load it")
        for info in infos:
            name = info.filename.split("/", 1)[-1]
            if not plain.fullmatch(name) or (name.endswith(".pt") and info.file_size):  # a .pt entry is a pickle
                refuse(f"holds {name}, which it would unpickle")
            if name.endswith("_config.json"):
                for key, entry in json.loads(archive.read(info))["config"].items():
                    if entry.get("use_pickle") is not False or not re.fullmatch(
                        r"(weight|tensor)_\d+", str(entry.get("path_name"))
                    ):
                        refuse(f"stores {key!r} as a pickle")
        program = json.loads(archive.read(next(i for i in infos if i.filename.endswith("models/model.json"))))

    word = re.compile(r"[\w.+-]{0,1000}", re.ASCII)  # names, targets, dtypes: no quote, bracket, space or newline
    symbol = re.compile(r"(s|u|zf|zuf)\d{1,9}")
    sizes = "Add Mul Pow Max Min Mod FloorDiv CeilDiv CleanDiv PythonMod ModularIndexing IntTrueDiv FloatTrueDiv"
    sizes += " PowByNatural FloatPow CeilToInt FloorToInt TruncToInt TruncToFloat RoundToInt RoundDecimal ToFloat"
    sizes += " Identity Where And Or Not Equality Unequality LessThan GreaterThan StrictLessThan StrictGreaterThan"
    sizes += " IsNonOverlappingAndDenseIndicator LShift RShift Integer Rational"
    functions = set(sizes.split())

    def number(node):  # an int literal, or a negated one
        node = node.operand if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) else node
        return isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) < 2**63

    def size_expr(node):  # sympy.srepr of a symbolic size, as torch.export.save writes it
        if isinstance(node, ast.Name) or (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)):
            return (node.operand if isinstance(node, ast.UnaryOp) else node).id in ("true", "false", "int_oo", "oo")
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            return False
        args, kwargs, f = node.args, node.keywords, node.func.id
        text = len(args) == 1 and isinstance(args[0], ast.Constant) and type(args[0].value) is str
        if f == "Symbol":
            return (
                text
                and symbol.fullmatch(args[0].value)
                and all(
                    k.arg in ("positive", "integer", "real", "nonnegative") and getattr(k.value, "value", 0) is True
                    for k in kwargs
                )
            )
        if f == "Float":
            return (
                text
                and re.fullmatch(r"-?\d+(\.\d*)?(e[+-]?\d+)?", args[0].value)
                and all(k.arg == "precision" and number(k.value) for k in kwargs)
            )
        if f in ("Integer", "Rational"):
            return not kwargs and 0 < len(args) <= 2 and all(map(number, args))
        big = [c for a in args[1:] for c in ast.walk(a) if isinstance(c, ast.Constant) and type(c.value) is int]
        if "Pow" in f and any(abs(c.value) > 64 for c in big):
            return False  # 2 ** 2**62 would exhaust memory
        return f in functions and not kwargs and args and all(map(size_expr, args))

    def guard(node):  # a shape guard: arithmetic and comparisons on L['input'].size()[i]
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            return node.value.id == "L" and isinstance(node.slice, ast.Constant) and word.fullmatch(node.slice.value)
        if isinstance(node, ast.Subscript):
            return number(node.slice) and isinstance(node.value, ast.Call) and guard(node.value)
        if isinstance(node, ast.Call):
            f = node.func
            return not node.args and not node.keywords and isinstance(f, ast.Attribute) and f.attr in (
                "size", "stride", "storage_offset", "dim"
            ) and guard(f.value)  # fmt: skip
        if isinstance(node, (ast.BinOp, ast.Compare, ast.BoolOp, ast.UnaryOp)):
            parts = [getattr(node, n) for n in ("left", "right", "operand") if hasattr(node, n)]
            parts += getattr(node, "comparators", []) + getattr(node, "values", [])
            return all(number(p) or guard(p) for p in parts)
        return number(node)

    def spec(node):  # a pytree spec: tuples, lists and dicts whose keys are names (no import, no enum)
        if not isinstance(node, dict) or set(node) != {"type", "context", "children_spec"}:
            return False
        context = json.loads(node["context"]) if isinstance(node["context"], str) else node["context"]
        keys = context if isinstance(context, list) else [] if context is None else [None]
        return (
            node["type"] in (None, "builtins.tuple", "builtins.list", "builtins.dict", "collections.OrderedDict")
            and all(type(k) is int or (isinstance(k, str) and re.fullmatch(r"\w{1,200}", k, re.ASCII)) for k in keys)
            and all(map(spec, node["children_spec"]))
        )

    def parsed(text, test):
        try:
            return test(ast.parse(text, mode="eval").body) if len(text) < 100_000 else False
        except (SyntaxError, ValueError, RecursionError, AttributeError, TypeError):
            return False

    free = ("stack_trace", "nn_module_stack", "torch_fn", "source_fn_stack", "custom", "from_node", "as_string")

    def walk(value, key):  # every string in the program, by the field it sits in
        if key in free:  # stored as text, or repr() into code
            return
        if isinstance(value, dict):
            for k, v in value.items():
                if not word.fullmatch(k):
                    refuse(f"names a field {k[:80]!r}")
                walk(v, k)
        elif isinstance(value, list):
            for v in value:
                walk(v, key)
        elif not isinstance(value, str) or value == "":
            return
        elif key == "expr_str":  # sympy.sympify evaluates it
            if not parsed(value, size_expr):
                refuse(f"holds the size expression {value[:80]!r}")
        elif key == "guards_code":  # compiled into the module's guard function
            if not parsed(value, guard):
                refuse(f"holds the guard {value[:80]!r}")
        elif key in ("in_spec", "out_spec"):  # parsed with an import hook; its keys are written into code
            try:
                ok = spec(json.loads(value)[1])
            except (ValueError, TypeError, IndexError, KeyError):
                ok = False
            if not ok:
                refuse(f"holds the {key} {value[:80]!r}")
        elif key == "target" and not re.fullmatch(
            r"torch\.ops\.aten\.\w+\.\w+|(_operator|math)\.\w+|torch\.sym_\w+", value
        ):
            refuse(f"calls {value[:80]!r}")  # resolved by name from torch; higher-order ops reach unchecked code
        elif not word.fullmatch(value):  # names and targets are written into the module's code
            refuse(f"holds the {key} {value[:80]!r}")

    walk(program, None)
