// The portable (scalar) paths of the matmul kernels sum each column's products in k order, one
// rounding per product and per sum, as their vector paths' one FMA per k does. The build's
// -fassociative-math (which lets the compiler vectorize the attention kernel's dot products)
// would otherwise let it regroup those sums, differently in the float32 and the quantized
// kernels, and the two must give the same bits. A portable path includes this before its
// first function: every function after it in the file keeps its sums in order.

#pragma once

#if defined(__clang__)
#pragma clang fp reassociate(off)
#elif defined(__GNUC__)
#pragma GCC optimize("no-associative-math")
#endif
