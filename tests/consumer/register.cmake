# Included by tests/CMakeLists.txt: registers `consumer_find_package`, which installs this build into
# a fresh prefix, configures tests/consumer against it with find_package(kda), builds and runs it.
# It needs the whole project built first (the install takes what the build produced).

set(kda_consumer_args
  -DKDA_BINARY_DIR=${PROJECT_BINARY_DIR}
  -DKDA_CONSUMER_SOURCE_DIR=${CMAKE_CURRENT_LIST_DIR}
  -DKDA_CONSUMER_WORK_DIR=${CMAKE_CURRENT_BINARY_DIR}/consumer
  -DKDA_CONFIG=$<CONFIG>
  "-DKDA_GENERATOR=${CMAKE_GENERATOR}"
  "-DKDA_MAKE_PROGRAM=${CMAKE_MAKE_PROGRAM}"
  "-DKDA_CXX_COMPILER=${CMAKE_CXX_COMPILER}"
  "-DKDA_BUILD_TYPE=${CMAKE_BUILD_TYPE}")
# Lists travel '|'-separated: add_test would split them at ';'.
foreach(var CMAKE_PREFIX_PATH CMAKE_CXX_FLAGS CMAKE_EXE_LINKER_FLAGS)
  string(REPLACE ";" "|" value "${${var}}")
  list(APPEND kda_consumer_args "-DKDA_${var}=${value}")
endforeach()
if(KDA_WITH_CUDA)
  # The installed package calls find_dependency(CUDAToolkit): point it at the toolkit we built with.
  get_filename_component(kda_cuda_root "${CUDAToolkit_BIN_DIR}" DIRECTORY)
  list(APPEND kda_consumer_args
    "-DKDA_CUDA_COMPILER=${CMAKE_CUDA_COMPILER}"
    "-DKDA_CUDAToolkit_ROOT=${kda_cuda_root}")
endif()

add_test(NAME consumer_find_package
  COMMAND ${CMAKE_COMMAND} ${kda_consumer_args} -P ${CMAKE_CURRENT_LIST_DIR}/run_consumer.cmake)
set_tests_properties(consumer_find_package PROPERTIES LABELS cpu TIMEOUT 600)
unset(kda_consumer_args)
