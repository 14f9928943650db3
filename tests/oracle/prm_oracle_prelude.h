/* The few kernel types and macros <linux/mlx5/mlx5_ifc.h> needs, so that gcc can compile it in user
 * space for tests/test_prm_oracle.py. Only the pseudo-structs' layout is read: offsetof of a
 * u8 member is its bit offset, sizeof its bit width (one u8 per bit), so the integer types' sizes
 * matter only for u8, which must be one byte. */
#ifndef GPUNET_PRM_ORACLE_PRELUDE_H
#define GPUNET_PRM_ORACLE_PRELUDE_H
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef uint8_t u8;
typedef uint16_t u16;
typedef uint32_t u32;
typedef uint64_t u64;
typedef uint16_t __be16;
typedef uint32_t __be32;
typedef uint64_t __be64;

#define BIT(n) (1UL << (n))
#define BIT_ULL(n) (1ULL << (n))
/* The kernel's include/linux/stddef.h: a flexible array member allowed inside a union. */
#define DECLARE_FLEX_ARRAY(TYPE, NAME) \
	struct { struct { } __empty_ ## NAME; TYPE NAME[]; }

_Static_assert(sizeof(u8) == 1, "mlx5_ifc.h pseudo-structs need a one-byte u8");
#endif
