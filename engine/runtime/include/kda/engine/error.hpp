// kda/engine/error.hpp — kda::Error, the one exception type of the C++ API (kda/error.hpp).
#pragma once

#include "kda/error.hpp"
