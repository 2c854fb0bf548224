/* The AMX tile set-up shared by knapspec's compiled kernels (row_linear.c, row_attention.c).
 *
 * Linux hands a process the tile registers only after it asks (arch_prctl with
 * ARCH_REQ_XCOMP_PERM for XTILEDATA); amx_permitted asks once per process and remembers the
 * answer. amx_configure loads the one tile configuration every kernel uses: palette 1,
 * eight tiles of 16 rows by 64 bytes (16 float32 or 32 bfloat16 per row); a thread calls it
 * before its first tile instruction. Include this header inside a block compiled only where
 * the tiles are (__AMX_TILE__ and __AMX_BF16__). Each kernel's cache key hashes this header
 * with its source (knapspec.model.kernels.compiled), so editing it rebuilds them.
 */
#ifndef KNAPSPEC_AMX_TILES_H
#define KNAPSPEC_AMX_TILES_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Whether the OS lets this process use the tile registers (asked once). */
static int amx_permitted(void) {
    static int state = 0;
    if (state == 0)
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

/* This thread's tiles: eight of 16 rows by 64 bytes. */
static void amx_configure(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}
#endif /* __AMX_TILE__ && __AMX_BF16__ */

#endif /* KNAPSPEC_AMX_TILES_H */
