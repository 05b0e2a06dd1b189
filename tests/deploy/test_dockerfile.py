"""The Dockerfile builds with the README's install and build scripts, runs as a
non-root user, exposes the server's ports, checks health with moh-client and
serves the demo models by default. (No Docker daemon here: it is read, not
built.)"""
import os
import re
import shlex

import pytest

from conftest import DEFAULT_METRICS_PORT, DEFAULT_PORT, SOURCE_DIR

INSTALL = "scripts/install_deps.sh"
BUILD = "scripts/build.sh"


def read(path):
    with open(os.path.join(SOURCE_DIR, path)) as f:
        return f.read()


def instructions(text):
    """[(INSTRUCTION, arguments)] with continuation lines joined and comment
    lines dropped, as Docker parses them."""
    out, current = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        if current.strip():
            word, _, rest = current.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        current = ""
    return out


def stages(text):
    """{stage name: [(INSTRUCTION, arguments)]}, in order; the last stage
    under the key None too."""
    result, name = {}, None
    for word, rest in instructions(text):
        if word == "FROM":
            m = re.match(r"(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", rest, re.I)
            name = m.group(2) or m.group(1)
            result[name] = [(word, rest)]
        elif name is not None:
            result[name].append((word, rest))
    result[None] = result[name]
    return result


def shell_commands(text):
    """Every simple command of a shell text, as argument lists."""
    commands = []
    for piece in re.split(r"&&|\|\||;|\n", text):
        try:
            words = shlex.split(piece, comments=True)
        except ValueError:
            continue
        if words:
            commands.append(words)
    return commands


def runs_script(commands, script):
    """Argument lists (script first) of the commands that run a file named
    like `script` (bash X, sh X, ./X, X; any directory: the image may copy it
    elsewhere)."""
    found = []
    for words in commands:
        if words[0] in ("bash", "sh") and len(words) > 1:
            words = words[1:]
        if os.path.basename(words[0]) == os.path.basename(script):
            found.append(words)
    return found


@pytest.fixture(scope="module")
def dockerfile():
    return read("Dockerfile")


def readme_install_commands():
    """The README's shell command blocks, and the scripts/*.sh they run
    followed one level down, as argument lists that run install_deps.sh."""
    readme = read("README.md")
    blocks = re.findall(r"```(?:sh|bash|console)\n(.*?)```", readme, re.S)
    commands = [c for b in blocks for c in shell_commands(b)]
    found = runs_script(commands, INSTALL)
    for words in commands:
        script = words[1] if words[0] in ("bash", "sh") and len(words) > 1 else words[0]
        if script.startswith("scripts/") and os.path.isfile(
                os.path.join(SOURCE_DIR, script)):
            found += runs_script(shell_commands(read(script)), INSTALL)
    return found


def test_readme_and_dockerfile_use_the_same_install_script(dockerfile):
    readme = readme_install_commands()
    assert readme, "the README's commands never run " + INSTALL
    runs = [c for w, rest in instructions(dockerfile) if w == "RUN"
            for c in shell_commands(rest)]
    installs = runs_script(runs, INSTALL)
    # The build installs exactly what the README's commands install (no
    # arguments: Debian's LibTorch; --torch=wheel: the CUDA build's; --bench,
    # the benchmark suite's llama.cpp peer, and --test, the test suite's
    # PyPI packages, are never part of an image); the runtime stage the
    # --runtime subset of the same script.
    assert [INSTALL] in installs, installs
    assert all(w[1:] in ([], ["--torch=wheel"], ["--bench"], ["--test"])
               for w in readme), readme
    assert not any(w[1:] in (["--bench"], ["--test"]) for w in installs), installs
    assert any(w[1:] == ["--torch=wheel"] for w in installs), installs
    assert any(w[1:2] == ["--runtime"] for w in installs), installs
    builds = runs_script(runs, BUILD)
    assert any({"moh-server", "moh-client"} <= set(w[1:]) for w in builds), builds
    # ... and the file it runs is the repository's.
    copied = [rest.split() for w, rest in instructions(dockerfile)
              if w == "COPY" and "--from" not in rest]
    for words in installs + builds:
        if words[0] in (INSTALL, BUILD):
            continue  # the build stage copies the whole context
        assert any(c[-1] == words[0] and c[0] == INSTALL for c in copied), words


def test_final_stage_is_a_non_root_server(dockerfile):
    final = stages(dockerfile)[None]
    words = [w for w, _ in final]
    users = [rest for w, rest in final if w == "USER"]
    assert users, "the final stage sets no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), user
    assert words.index("USER") < max(i for i, w in enumerate(words)
                                     if w in ("CMD", "ENTRYPOINT"))

    exposed = {p.split("/")[0] for w, rest in final if w == "EXPOSE"
               for p in rest.split()}
    assert {str(DEFAULT_PORT), str(DEFAULT_METRICS_PORT)} <= exposed

    health = [rest for w, rest in final if w == "HEALTHCHECK"]
    assert health, "no HEALTHCHECK"
    assert "moh-client" in health[0] and '"health"' in health[0]
    assert "--server=localhost:%d" % DEFAULT_PORT in health[0]


def test_base_images_are_debian_12(dockerfile):
    """Every FROM is Debian 12 or an earlier stage (`stage-${TORCH_VARIANT}`
    for every variant the Dockerfile has)."""
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", dockerfile, re.M))
    names = [n for n in stages(dockerfile) if n]
    for word, rest in instructions(dockerfile):
        if word != "FROM":
            continue
        image = rest.split()[0]
        variant = re.fullmatch(r"([\w-]+)-\$\{TORCH_VARIANT\}", image)
        if variant:
            for v in ("cpu", "cuda"):
                assert "%s-%s" % (variant.group(1), v) in names, image
            continue
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        assert image in names or image.startswith("debian:bookworm"), image


def demo_model_names():
    """The directories DemoServerConfig expects under --demo_dir."""
    source = read("service/config/server_config.cc")
    body = source[source.index("DemoServerConfig("):]
    body = body[:body.find("\n}\n") + 1 or None]
    # demo_dir + "/x", StrCat(demo_dir, "/x"), path(demo_dir) / "x"
    names = re.findall(r'demo_dir\)?\s*[+,/]\s*"/?([^"]+)"', body)
    assert names, "cannot find the demo model directories in DemoServerConfig"
    return names


def test_image_serves_the_demo_models(dockerfile):
    final = stages(dockerfile)[None]
    cmd = " ".join(rest for w, rest in final if w in ("ENTRYPOINT", "CMD"))
    assert "moh-server" in cmd
    m = re.search(r"--demo_dir=([^\s\"\]]+)", cmd)
    assert m, "the default command does not name the demo models"
    demo_dir = m.group(1)
    copies = [rest for w, rest in final if w == "COPY"]
    assert any(c.split()[-1].rstrip("/") == demo_dir for c in copies), copies
    # The image takes the repository's models/ when there is one: it must
    # hold the directories the server looks for.
    models = os.path.join(SOURCE_DIR, "models")
    assert "models" in dockerfile
    if os.path.isdir(models):
        for name in demo_model_names():
            assert os.path.isdir(os.path.join(models, name)), (
                "models/%s missing (DemoServerConfig serves it)" % name)
    else:
        # Fallback: the test suite's generated models.
        fixtures = read("tests/reference/make_fixtures.py")
        for name in demo_model_names():
            assert '"%s"' % name in fixtures, name


def test_cuda_variant_uses_the_ci_torch_wheel(dockerfile):
    """The CUDA variant builds against the LibTorch of CI's CUDA build: the
    PyPI torch wheel that `install_deps.sh --torch=wheel` installs, built with
    `build.sh --torch=wheel`; its runtime has no Debian LibTorch and carries
    the wheel's libraries from that stage."""
    all_stages = stages(dockerfile)
    assert "torch-cuda" in all_stages and "runtime-cuda" in all_stages
    cuda = all_stages["torch-cuda"]
    runs = [c for w, rest in cuda if w == "RUN" for c in shell_commands(rest)]
    assert [INSTALL, "--torch=wheel"] in runs_script(runs, INSTALL), runs
    assert ("ENV", "MOH_TORCH=wheel") in cuda
    assert ("ENV", "MOH_TORCH=debian") in all_stages["torch-cpu"]
    build = [c for w, rest in all_stages["build"] if w == "RUN"
             for c in shell_commands(rest)]
    assert any(w[1:2] == ["--torch=$MOH_TORCH"]
               for w in runs_script(build, BUILD)), build
    runtime = " ".join(rest for _, rest in all_stages["runtime-cuda"])
    assert "--runtime-no-torch" in runtime and "--from=torch-cuda" in runtime


def test_dockerignore_keeps_build_trees_out():
    ignored = [l.strip() for l in read(".dockerignore").splitlines()
               if l.strip() and not l.startswith("#")]
    for pattern in ("build", "build-*", ".git"):
        assert pattern in ignored, pattern
    assert not any(p.rstrip("/") in ("models", "scripts", "service", "model",
                                     "proto", "client")
                   for p in ignored)
