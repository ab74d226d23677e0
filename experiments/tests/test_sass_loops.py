"""experiments.scripts.sass_loops: loops found and classified from cuobjdump-style text."""
from experiments.scripts import sass_loops

SASS = """
        Function : k
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0030*/                   LOP3.LUT R3, R3, 0xf, RZ, 0xc0, !PT ;
        /*0040*/              @P0 BRA 0x20 ;
        /*0050*/                   STG.E [R2.64], R4 ;
        /*0060*/             @!P1 BRA 0x10 ;
        /*0070*/                   BRA 0x0 ;
        /*0080*/                   EXIT ;
"""


def test_inner_and_outer_mma_loops():
    ins = sass_loops.parse(SASS)["k"]
    assert [i[1] for i in ins][:3] == ["MOV", "IADD3", "HMMA.16816.F32.BF16"] and len(ins) == 9
    loops = sass_loops.mma_loops(ins)
    got = [(lp["start"], lp["end"], lp["instructions"], lp["hmma"], lp["inner"]) for lp in loops]
    assert got == [(0x0, 0x70, 8, 1, False), (0x10, 0x60, 6, 1, False), (0x20, 0x40, 3, 1, True)]
    assert loops[2]["ops"]["LOP3"] == 1 and loops[2]["ops"]["BRA"] == 1


BRANCHY = """
        Function : b
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/              @P0 BRA 0x50 ;
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0030*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0040*/                   BRA 0x70 ;
        /*0050*/                   LOP3.LUT R3, R3, 0xf, RZ, 0xc0, !PT ;
        /*0060*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0070*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0080*/              @P1 BRA 0x0 ;
        /*0090*/                   EXIT ;
"""


def test_mma_blocks_split_at_branches_and_targets():
    ins = sass_loops.parse(BRANCHY)["b"]
    loop = sass_loops.mma_loops(ins)[0]
    # [MOV, BRA] has no HMMA; [HMMA, HMMA, BRA]; [LOP3, HMMA] ends at the target 0x70; [IADD3, BRA] none
    assert sass_loops.mma_blocks(ins, loop) == [(3, 2), (2, 1)]
