"""A gemmtune kernel compiled for an H100 on a machine without one, for tests that check the
code Triton generates (PTX) or how it is compiled: in a child process, outside Triton's
interpreter."""

import json
import os
import subprocess
import sys

PROBE = """
import json, sys
import triton
import ptx

source, target, options = ptx.sm90_source(*json.loads(sys.argv[1]))
print(triton.compile(source, target=target, options=options).asm["ptx"])
"""


def sm90_source(module: str, scalars: tuple, constexprs: dict, descriptors: dict | None = None) -> tuple:
    """``gemmtune.backends.kernels.<module>.<module>_matmul`` as ``triton.compile`` takes it (source,
    target, options) for sm_90, with bf16 operands on 16-byte boundaries, its integer arguments
    ``scalars`` specialized as the JIT would, ``constexprs`` (num_warps and num_stages among
    them), and ``descriptors``: each TMA descriptor argument's block shape. Outside Triton's
    interpreter only."""
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module("gemmtune.backends.kernels." + module), module + "_matmul")
    constexprs = dict(constexprs)
    options = {name: constexprs.pop(name) for name in ("num_warps", "num_stages")}
    constexprs = {name: tuple(v) if isinstance(v, list) else v for name, v in constexprs.items()}
    descriptors = descriptors or {}
    params = [name for name in fn.arg_names
              if not name.endswith("_ptr") and name not in constexprs and name not in descriptors]
    values = dict(zip(params, scalars))
    signature, fixed, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in descriptors:
            signature[name] = f"tensordesc<bf16{list(descriptors[name])}>"
        elif name.endswith("_ptr"):
            signature[name], attrs[(i,)] = "*bf16", [["tt.divisibility", 16]]
        elif name in constexprs or values[name] == 1:  # the JIT turns integers equal to 1 into constants
            signature[name], fixed[(i,)] = "constexpr", constexprs.get(name, 1)
        else:
            signature[name] = "i32"
            if values[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn, signature, fixed, attrs), GPUTarget("cuda", 90, 32), options


def outside_interpreter(script: str, *args: str, env: dict | None = None) -> str:
    """``script`` run by this Python in a child process without Triton's interpreter, this
    directory importable; its standard output. Fails the test on a non-zero exit."""
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def sm90_ptx(module: str, scalars: tuple, constexprs: dict, descriptors: dict | None = None) -> str:
    """``sm90_source``'s kernel compiled to PTX."""
    return outside_interpreter(PROBE, json.dumps([module, scalars, constexprs, descriptors]))


def sm90_sass(module: str, scalars: tuple, constexprs: dict) -> list[str]:
    """``sm90_ptx``'s kernel assembled by the ptxas that ships with Triton, as its SASS
    instructions (opcode and operands, one per item)."""
    import re
    import tempfile

    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(sm90_ptx(module, scalars, constexprs))
        subprocess.run([os.path.join(tools, "ptxas"), "-arch=sm_90a", ptx, "-o", cubin], check=True, timeout=300)
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-sass", cubin], capture_output=True,
                              text=True, check=True, timeout=300).stdout
    return [line.split("*/", 1)[1].split(";")[0].strip() for line in sass.splitlines()
            if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
