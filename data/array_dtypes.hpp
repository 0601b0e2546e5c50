// The element types of array files in one table: for each, NumPy's name, the safetensors
// header's name and the bytes of an element (array_dtype_name, array_dtype_size and the
// safetensors reader and writer all read it).
#pragma once
#include <cstddef>

#include <dptrain/data/array.hpp>

namespace dpt::data {

struct ArrayDTypeInfo {
  ArrayDType type;
  const char* numpy;        // "float32", "uint8", "bfloat16", ...
  const char* safetensors;  // "F32", "U8", "BF16", ...
  size_t size;
};
// The row of `t` (a row named "?" of size 1 for a value outside the enum, which a cast can make).
const ArrayDTypeInfo& array_dtype_info(ArrayDType t);

}  // namespace dpt::data
