"""benchmarks/vllm_carry/carry.py: the pinned list is the vllm closure less the GPU image's
packages and the optional ones; the trimmed wheel loses exactly the named members and their
RECORD lines; the chunks reassemble to the tar their checksum names, the same bytes each time;
a wheel set that differs from the list is named. (prepare.sh downloads; it never runs here.)"""

import hashlib
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

CARRY = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_carry"
sys.path.insert(0, str(CARRY))
import carry  # noqa: E402


def item(name, version, sha="ab" * 32):
    url = f"https://files.example/{name.replace('-', '_')}-{version}-py3-none-any.whl"
    return {
        "metadata": {"name": name, "version": version},
        "download_info": {"url": url, "archive_info": {"hashes": {"sha256": sha}}},
    }


def test_pin_keeps_what_the_image_lacks_less_the_optional_wheels():
    report = {
        "install": [
            item("vllm", "0.26.0"),
            item("Torch", "2.11.0"),
            item("tilelang", "0.1.9"),
            item("xgrammar", "0.2.3"),
        ]
    }
    lines = carry.pin(report)
    assert lines == [
        f"vllm==0.26.0 --hash=sha256:{'ab' * 32}  # vllm-0.26.0-py3-none-any.whl",
        f"xgrammar==0.2.3 --hash=sha256:{'ab' * 32}  # xgrammar-0.2.3-py3-none-any.whl",
    ]  # torch is in the image (any spelling), tilelang is optional
    assert carry.canonical("Nvidia_CUDNN.cu13") == "nvidia-cudnn-cu13"


def test_the_committed_list_is_vllm_0_26_and_93_wheels_without_the_image_or_optional_ones():
    wheels = carry.pinned()
    names = {name for name, _ in wheels.values()}
    assert len(wheels) == 93 and any(f.startswith("vllm-0.26.0-") for f in wheels)
    assert not names & {carry.canonical(n) for n in carry.IMAGE_PACKAGES} and not names & carry.OPTIONAL
    assert "torch" in carry.IMAGE_PACKAGES and all(len(sha) == 64 for _, sha in wheels.values())


def make_wheel(path):
    members = {
        "vllm/__init__.py": b"x = 1\n",
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"\0" * 5000,
        "vllm/vllm_flash_attn/flash_attn_interface.py": b"try: pass\nexcept ImportError: pass\n",
        "vllm/vllm-rs": b"\1" * 3000,
    }
    record = "".join(f"{m},sha256=x,{len(d)}\n" for m, d in members.items()) + "vllm-0.26.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr("vllm-0.26.0.dist-info/RECORD", record)
    return path


def test_trim_drops_the_named_members_and_their_record_lines(tmp_path):
    wheel = make_wheel(tmp_path / "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl")
    assert carry.trim(wheel) > 0
    with zipfile.ZipFile(wheel) as z:
        assert z.testzip() is None
        assert sorted(z.namelist()) == [
            "vllm-0.26.0.dist-info/RECORD",
            "vllm/__init__.py",
            "vllm/vllm_flash_attn/flash_attn_interface.py",
        ]
        record = z.read("vllm-0.26.0.dist-info/RECORD").decode()
    assert "_vllm_fa2_C" not in record and "vllm-rs" not in record and "vllm/__init__.py" in record


def test_pack_cuts_a_reproducible_tar_that_reassembles_to_its_checksum(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i in range(3):
        (wheels / f"w{i}-1.0-py3-none-any.whl").write_bytes(bytes(range(256)) * (40 + i))
    parts, digest = carry.pack(wheels, tmp_path / "out", chunk_bytes=10_000)
    size = sum(p.stat().st_size for p in parts)
    assert len(parts) == -(-size // 10_000) and [p.name for p in parts][:2] == ["part-00", "part-01"]
    assert all(p.stat().st_size == 10_000 for p in parts[:-1]) and 0 < parts[-1].stat().st_size <= 10_000
    whole = b"".join(p.read_bytes() for p in parts)
    assert hashlib.sha256(whole).hexdigest() == digest
    assert (tmp_path / "out" / "lean.sha256").read_text() == f"{digest}  lean.tar\n"
    (tmp_path / "out" / "lean.tar").write_bytes(whole)  # what the device does, sha256sum included
    check = subprocess.run(["sha256sum", "-c", "lean.sha256"], cwd=tmp_path / "out", capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    with tarfile.open(tmp_path / "out" / "lean.tar") as tar:
        assert tar.getnames() == [f"w{i}-1.0-py3-none-any.whl" for i in range(3)]
        assert all(m.mtime == 0 and m.uid == 0 for m in tar.getmembers())
    for p in wheels.iterdir():  # new file times: the same bytes
        p.touch()
    assert carry.pack(wheels, tmp_path / "again", chunk_bytes=10_000)[1] == digest


def test_verify_names_missing_extra_and_altered_wheels(tmp_path):
    (tmp_path / "a-1-py3-none-any.whl").write_bytes(b"a")
    (tmp_path / "b-1-py3-none-any.whl").write_bytes(b"changed")
    (tmp_path / "extra-1-py3-none-any.whl").write_bytes(b"x")
    sha = lambda data: hashlib.sha256(data).hexdigest()
    wheels = {
        "a-1-py3-none-any.whl": ("a", sha(b"a")),
        "b-1-py3-none-any.whl": ("b", sha(b"b")),
        "c-1-py3-none-any.whl": ("c", sha(b"c")),
    }
    assert carry.verify(tmp_path, wheels) == [
        "missing c-1-py3-none-any.whl",
        "not pinned extra-1-py3-none-any.whl",
        "hash differs b-1-py3-none-any.whl",
    ]
    (tmp_path / "extra-1-py3-none-any.whl").unlink()
    (tmp_path / "b-1-py3-none-any.whl").write_bytes(b"b")
    (tmp_path / "c-1-py3-none-any.whl").write_bytes(b"c")
    assert carry.verify(tmp_path, wheels) == []


def test_the_command_line_says_what_differs_in_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, str(CARRY / "carry.py"), "verify", str(tmp_path)], capture_output=True, text=True
    )
    assert done.returncode == 1 and done.stdout.count("\n") == 1 and "missing vllm-0.26.0-" in done.stdout
