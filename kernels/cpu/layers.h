// placeholder until the kernel lands
#pragma once
#define MINDIE_LAYER_KERNELS(X)
