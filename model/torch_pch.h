// Precompiled header for translation units that use LibTorch (ATen only).
#pragma once
#include <ATen/ATen.h>
#include <c10/core/ScalarType.h>
#include <torch/types.h>
