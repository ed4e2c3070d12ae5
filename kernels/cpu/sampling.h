// placeholder until the kernel lands
#pragma once
#define MINDIE_SAMPLING_KERNELS(X)
