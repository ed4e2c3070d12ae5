// placeholder until the kernel lands
#pragma once
#define MINDIE_BEAM_SEARCH_KERNELS(X)
