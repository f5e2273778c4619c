"""The hand-written stub torch_pccl/_pccl_native.pyi agrees with pccl.h.

``_Lib`` in the stub must declare exactly what cffi's ``lib`` exposes: every
function, enum constant and ``#define`` of the cdef section of
native/include/pccl.h (the text the builder passes to ``ffi.cdef``), each
function with the C prototype's parameters in order (same count and names,
``int`` for scalars, not ``int`` for pointers) and an ``int`` result exactly
when C returns a scalar. Pure parsing (pycparser, which cffi itself uses, and
``ast``): the compiled extension is not needed.
"""

import ast
import importlib.util
import os
import re

from pycparser import c_ast, c_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILDER = os.path.join(ROOT, "torch_pccl", "_build_native.py")
STUB = os.path.join(ROOT, "torch_pccl", "_pccl_native.pyi")

# The <stdint.h>/<stddef.h> names the cdef may use; pycparser parses
# preprocessed C, so it is told they are types (cffi knows them built in).
_STD_TYPES = ("size_t", "ssize_t", "int8_t", "int16_t", "int32_t", "int64_t", "uint8_t",
              "uint16_t", "uint32_t", "uint64_t", "intptr_t", "uintptr_t")
_DEFINE = re.compile(r"\s*#\s*define\s+(\w+)\s+(\S+)\s*$")


def _cdef_text():
    """The cdef text exactly as the builder reads it from pccl.h."""
    spec = importlib.util.spec_from_file_location("_pccl_builder_under_test", BUILDER)
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    return builder._cdef_text(builder._HEADER)


def _is_pointer(decl_type, typedefs):
    """True for a pointer or array, also behind typedefs (pcclComm_t is a pointer)."""
    while isinstance(decl_type, c_ast.TypeDecl):
        names = getattr(decl_type.type, "names", None)  # IdentifierType; Enum/Struct have none
        if not names or len(names) != 1 or names[0] not in typedefs:
            break
        decl_type = typedefs[names[0]]
    return isinstance(decl_type, (c_ast.PtrDecl, c_ast.ArrayDecl))


class _Enumerators(c_ast.NodeVisitor):
    def __init__(self):
        self.names = set()

    def visit_Enumerator(self, node):
        self.names.add(node.name)


def _parse_cdef():
    """(functions, constants): name -> ([(param, is_pointer)], returns_pointer); set of names."""
    text = re.sub(r"/\*.*?\*/", " ", _cdef_text(), flags=re.S)
    defines, lines = set(), []
    for line in text.splitlines():
        m = _DEFINE.match(line)
        if m:
            defines.add(m.group(1))
            continue
        assert not line.lstrip().startswith("#"), f"directive this test cannot read: {line!r}"
        lines.append(line)
    prelude = "".join(f"typedef int {t};\n" for t in _STD_TYPES)
    tree = c_parser.CParser().parse(prelude + "\n".join(lines), filename="pccl.h cdef")
    functions, typedefs = {}, {}
    for node in tree.ext:
        if isinstance(node, c_ast.Typedef):
            typedefs[node.name] = node.type
        elif isinstance(node, c_ast.Decl) and isinstance(node.type, c_ast.FuncDecl):
            params = []
            for p in (node.type.args.params if node.type.args else []):
                is_void = (p.name is None and isinstance(p.type, c_ast.TypeDecl)
                           and getattr(p.type.type, "names", None) == ["void"])
                if not is_void:
                    params.append((p.name, _is_pointer(p.type, typedefs)))
            functions[node.name] = (params, _is_pointer(node.type.type, typedefs))
    enumerators = _Enumerators()
    enumerators.visit(tree)
    return functions, enumerators.names | defines


def _parse_stub():
    """(methods, attributes) of the stub's _Lib: name -> FunctionDef; name -> annotation text."""
    with open(STUB, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=STUB)
    lib = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "_Lib"]
    assert len(lib) == 1, "the stub must define one class _Lib"
    methods, attributes = {}, {}
    for node in lib[0].body:
        if isinstance(node, ast.FunctionDef):
            assert node.name not in methods, f"_Lib.{node.name} declared twice"
            methods[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            assert node.target.id not in attributes, f"_Lib.{node.target.id} declared twice"
            attributes[node.target.id] = ast.unparse(node.annotation)
        else:
            raise AssertionError(f"_Lib line {node.lineno}: only methods and annotated names")
    return methods, attributes


def _diff(label, stub_names, c_names):
    missing, extra = sorted(c_names - stub_names), sorted(stub_names - c_names)
    parts = [f"{label} in pccl.h but not in the stub: {missing}"] if missing else []
    parts += [f"{label} in the stub but not in pccl.h: {extra}"] if extra else []
    return parts


def test_cdef_parse_finds_the_api():
    # Guards the parser itself: empty sets would make the other tests vacuous.
    functions, constants = _parse_cdef()
    assert {"pcclCommCreate", "pcclAllReduce", "pcclP2PBatch", "pcclGetLastError"} <= set(functions)
    assert {"pcclSuccess", "pcclFloat32", "pcclSum", "pcclQuantInt8", "PCCL_MAX_LANES"} <= constants
    assert functions["pcclGetLastError"] == ([], True)
    assert functions["pcclCommConnect"] == ([("comm", True), ("addrs", True),
                                             ("timeout_ms", False)], False)


def test_stub_declares_exactly_the_cdef_names():
    functions, constants = _parse_cdef()
    methods, attributes = _parse_stub()
    problems = _diff("functions", set(methods), set(functions))
    problems += _diff("constants", set(attributes), constants)
    problems += [f"_Lib.{name} is annotated {ann}, not int"
                 for name, ann in sorted(attributes.items()) if ann != "int"]
    assert not problems, "\n".join(problems)


def test_stub_functions_match_the_prototypes():
    functions, _ = _parse_cdef()
    methods, _ = _parse_stub()
    problems = []
    for name in sorted(set(functions) & set(methods)):
        c_params, c_returns_pointer = functions[name]
        args = methods[name].args
        if args.posonlyargs or args.vararg or args.kwonlyargs or args.kwarg or args.defaults:
            problems.append(f"{name}: the stub must list plain positional parameters only")
            continue
        if not args.args or args.args[0].arg != "self":
            problems.append(f"{name}: the stub method's first parameter must be self")
            continue
        stub_params = args.args[1:]
        if len(stub_params) != len(c_params):
            problems.append(f"{name}: the stub takes {len(stub_params)} argument(s), "
                            f"pccl.h {len(c_params)}")
            continue
        for i, (arg, (c_name, c_pointer)) in enumerate(zip(stub_params, c_params)):
            if arg.arg != c_name:
                problems.append(f"{name}: argument {i} is {arg.arg!r} in the stub, "
                                f"{c_name!r} in pccl.h")
            ann = ast.unparse(arg.annotation) if arg.annotation else None
            if (ann == "int") == c_pointer:
                problems.append(f"{name}({c_name}): annotated {ann} for a C "
                                f"{'pointer' if c_pointer else 'scalar'}")
        ret = ast.unparse(methods[name].returns) if methods[name].returns else None
        if (ret == "int") == c_returns_pointer:
            problems.append(f"{name}: returns {ret} in the stub for a C "
                            f"{'pointer' if c_returns_pointer else 'scalar'}")
    assert not problems, "\n".join(problems)
