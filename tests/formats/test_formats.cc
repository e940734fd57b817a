// PLACEHOLDER: tests are being written.
#include "tests/common/test_util.h"
