"""tools/sass_diff.py on made-up `cuobjdump -sass` listings: no GPU or nvcc needed (c++filt
demangles the names)."""

from __future__ import annotations

import shutil
import sys

import pytest
from tool_scripts import load_tool

sass_diff = load_tool("sass_diff")

pytestmark = pytest.mark.skipif(shutil.which("c++filt") is None, reason="no c++filt")


def listing(functions: dict[str, list[str]]) -> str:
    """A listing as cuobjdump writes one: each function's header, then one instruction a line
    with its address in a comment and its encoding after it."""
    out = ["code for sm_90"]
    for name, code in functions.items():
        out += ["", f"\t\tFunction : {name}", '\t.headerflags\t@"EF_CUDA_SM90"']
        for i, ins in enumerate(code):
            out.append(f"        /*{16 * i:04x}*/                   {ins} ;   /* 0x000 */")
            out.append("                                                  /* 0x000 */")
    return "\n".join(out) + "\n"


# void f<1, true>(int) and void f<1, false>(int); g(int)
F_TRUE, F_FALSE, G = "_Z1fILi1ELb1EEvi", "_Z1fILi1ELb0EEvi", "_Z1gi"


def run(tmp_path, capsys, old, new, *args) -> list[str]:
    (tmp_path / "old.sass").write_text(listing(old))
    (tmp_path / "new.sass").write_text(listing(new))
    argv = ["sass_diff", str(tmp_path / "old.sass"), str(tmp_path / "new.sass"), *args]
    sys.argv = argv
    assert sass_diff.main() == 0
    return capsys.readouterr().out.splitlines()


def test_functions_are_matched_by_their_demangled_names_and_renames(tmp_path, capsys):
    body = ["MOV R1, c[0x0][0x28]", "IADD3 R2, R1, 0x4, RZ", "EXIT"]
    old = {F_TRUE: body, G: ["EXIT"]}
    new = {F_FALSE: body, G: ["NOP", "EXIT"]}
    got = run(tmp_path, capsys, old, new)
    assert "new      void f<1, false>(int) (3 instructions)" in got
    assert "gone     void f<1, true>(int)" in got
    assert "changed  g(int): 1 -> 2 (instructions)" in got
    assert got[-1] == "0 of 1 functions in both byte for byte the same"
    got = run(tmp_path, capsys, old, new, "--rename", r"f<1, (true|false)>=>f<1>")
    assert got == [
        "changed  g(int): 1 -> 2 (instructions)",
        "1 of 2 functions in both byte for byte the same",
    ]


def test_registers_alone_are_told_from_instructions(tmp_path, capsys):
    old = {G: ["MOV R1, R2", "@P0 BRA 0x40", "EXIT"]}
    new = {G: ["MOV R5, R7", "@P1 BRA 0x80", "EXIT"]}
    assert run(tmp_path, capsys, old, new)[0] == "changed  g(int): 3 -> 3 (registers only)"
    got = run(tmp_path, capsys, old, new, "--show", "g(int)")
    assert got == ["the same once registers and branch targets are blanked"]
    new[G][0] = "MOV R5, R8"
    new[G].insert(1, "NOP")
    got = run(tmp_path, capsys, old, new, "--show", "g(int)")
    assert "+NOP" in got and not any(line.startswith("-") and "MOV" in line for line in got)


def test_loops_are_counted_with_their_opcodes(tmp_path, capsys):
    # a wait's one-instruction retry loop, then a loop of 5 instructions back to index 2
    body = [
        "MOV R1, c[0x0][0x28]",
        "@!P0 BRA 0x10",
        "LDS R2, [R1]",
        "FFMA R3, R2, R2, R3",
        "@P1 FFMA.FTZ R4, R2, R3, R4",
        "IADD3 R1, R1, 0x4, RZ",
        "@!P2 BRA P1, 0x20",
        "EXIT",
        "BRA 0x20",  # a slow path's jump back: not a loop
    ]
    new = {G: body[:4] + ["FFMA R5, R2, R2, R5"] + body[4:]}
    got = run(tmp_path, capsys, {G: body}, new, "--loops", "g(int)", "--min", "2")
    assert got == [
        "old loop 0x0020-0x0060: 5 instructions (FFMA 2, LDS 1, IADD3 1, BRA 1)",
        "new loop 0x0020-0x0070: 6 instructions (FFMA 3, LDS 1, IADD3 1, BRA 1)",
    ]
    # the retry loop at index 1 (its own target) is one instruction: shown only at --min 1
    got = run(tmp_path, capsys, {G: body}, new, "--loops", "g(int)", "--min", "1")
    assert got[0] == "old loop 0x0010-0x0010: 1 instructions (BRA 1)"
    assert len(got) == 4  # and each side's loop at 0x20; the jump back from 0x80 is none
