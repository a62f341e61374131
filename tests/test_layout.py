"""How the code is laid out (docs/layout.md): imports point one way (scripts -> train_gpt2 -> nanogpt),
no module imports at module level one that imports it back, importing train_gpt2 imports no script, no
function imports a script (to break a circle), fineweb.py loads no torch, and `python train_gpt2.py` executes
its source once.

    python -m pytest -q tests/test_layout.py
"""

import ast
import json
import os
import subprocess
import sys

from conftest import ROOT, make_shards, write_hellaswag

SCRIPTS = ("train_gpt2", "fineweb", "hellaswag", "evaluate", "generate_tokens", "plot_log")


def project_modules():
    """{module name: path} of the scripts and of the package's modules."""
    modules = {name: os.path.join(ROOT, f"{name}.py") for name in SCRIPTS}
    package = os.path.join(ROOT, "nanogpt")
    for file in sorted(os.listdir(package)):
        if file.endswith(".py") and file != "__init__.py":
            modules[f"nanogpt.{file[:-3]}"] = os.path.join(package, file)
    return modules


def top_level_imports(path, known):
    """The project modules a file imports at module level (not inside functions)."""
    found = set()
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # from nanogpt import hf
    return found & set(known)


def imports_in_functions(path):
    """(function, module) of every import inside a function body of a file."""
    found = []
    for function in ast.walk(ast.parse(open(path).read())):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, ast.Import):
                    found.extend((function.name, alias.name) for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module:
                    found.append((function.name, node.module))
    return found


def test_imports_point_one_way_and_never_in_a_circle():
    modules = project_modules()
    graph = {name: top_level_imports(path, modules) for name, path in modules.items()}
    for name, imported in graph.items():
        if name.startswith("nanogpt."):
            assert not imported & set(SCRIPTS), (name, imported)  # the package imports no script
    assert not graph["fineweb"] & {"train_gpt2", "hellaswag", "evaluate", "generate_tokens"}
    # command lines over the package's scoring and train_gpt2's load_model, imported at their top
    for script, scoring in (("hellaswag", "nanogpt.hellaswag_eval"), ("evaluate", "nanogpt.core_eval")):
        assert {"train_gpt2", scoring} <= graph[script], (script, graph[script])
    assert not graph["train_gpt2"] & set(SCRIPTS)  # the loop's HellaSwag and CORE are the package's
    assert graph["train_gpt2"] >= {"nanogpt.hellaswag_eval", "nanogpt.core_eval", "nanogpt.loop_evals"}

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in graph[start])

    circles = [name for name in graph if reaches(name, name)]
    assert not circles, circles


def test_no_function_imports_a_script():
    """An import inside a function is how a circle is hidden: no function of a script or of the package imports
    a script (train_gpt2 included); with the module-level imports above, the package imports none anywhere."""
    for name, path in project_modules().items():
        in_functions = [(function, module) for function, module in imports_in_functions(path)
                        if module.split(".")[0] in SCRIPTS]
        assert not in_functions, (name, in_functions)


def run_python(code, *args):
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=300)


def test_fineweb_loads_no_torch_and_train_gpt2_no_script():
    result = run_python("import sys, json, train_gpt2; print(json.dumps(sorted(sys.modules)))")
    assert result.returncode == 0, result.stderr
    assert not set(json.loads(result.stdout)) & (set(SCRIPTS) - {"train_gpt2"})
    result = run_python("import sys, json, hellaswag, evaluate; print(json.dumps(sorted(sys.modules)))")
    assert result.returncode == 0, result.stderr
    assert {"train_gpt2", "nanogpt.hellaswag_eval", "nanogpt.core_eval"} <= set(json.loads(result.stdout))
    result = run_python("import sys, fineweb; print('torch' in sys.modules)")
    assert result.stdout.strip() == "False", result.stderr


# A training run of `python train_gpt2.py` (its source run as __main__) that reports every import of a module
# named train_gpt2: one would execute the file a second time, with module state of its own.
TRACE = """
import atexit, runpy, sys
imports = []
sys.addaudithook(lambda event, args: event == "import" and args[0] == "train_gpt2" and imports.append(args[0]))
atexit.register(lambda: print("imports of train_gpt2:", len(imports)))
sys.argv = ["train_gpt2.py", *sys.argv[1:]]
runpy.run_path("train_gpt2.py", run_name="__main__")
"""


def test_python_train_gpt2_executes_its_source_once(tmp_path):
    """The whole loop runs: validation, in-loop HellaSwag, samples and a checkpoint."""
    data = make_shards(str(tmp_path / "data"))
    hella = write_hellaswag(str(tmp_path / "hellaswag.jsonl"), n=4)
    result = run_python(TRACE, "--model", "tiny", "--n_layer", "1", "--n_head", "1", "--n_embd", "8", "--seq_len", "16",
                        "--batch_size", "2", "--total_batch_size", "32", "--max_steps", "2", "--eval_every", "1",
                        "--val_steps", "1", "--hellaswag_every", "1", "--hellaswag_data", hella, "--sample_every", "1",
                        "--device", "cpu", "--no_compile", "--data_dir", data, "--log_dir", str(tmp_path / "log"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "HellaSwag acc_norm" in result.stdout and "--- sample 1/4 ---" in result.stdout
    assert result.stdout.strip().endswith("imports of train_gpt2: 0"), result.stdout[-500:]
