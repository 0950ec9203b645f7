# Included by tests/CMakeLists.txt. Registers two tests that install this build into a fresh prefix,
# configure a separate project against it with find_package(kda), build it and run it
# (run_consumer.cmake):
#   consumer_find_package  tests/consumer: the public headers and every exported library
#   readme_examples        tests/readme: the C and C++ examples of README.md and docs/**/*.md, as
#                          written
# They need the whole project built first (the install takes what the build produced).
# In a CUDA build, consumer_find_package links the CUDA libraries (CUDAToolkit found as in this
# build) and readme_examples configures with CMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit: a consumer
# without the toolkit gets the CPU-only libraries of the same install (unless KDA_CPU_LIBRARIES is
# OFF: then it links the CUDA libraries too).

set(kda_consumer_common_args
  -DKDA_BINARY_DIR=${PROJECT_BINARY_DIR}
  -DKDA_CONFIG=$<CONFIG>
  "-DKDA_GENERATOR=${CMAKE_GENERATOR}"
  "-DKDA_MAKE_PROGRAM=${CMAKE_MAKE_PROGRAM}"
  "-DKDA_CXX_COMPILER=${CMAKE_CXX_COMPILER}"
  "-DKDA_C_COMPILER=${CMAKE_C_COMPILER}"
  "-DKDA_BUILD_TYPE=${CMAKE_BUILD_TYPE}")
# Lists travel '|'-separated: add_test would split them at ';'.
foreach(var CMAKE_PREFIX_PATH CMAKE_CXX_FLAGS CMAKE_C_FLAGS CMAKE_EXE_LINKER_FLAGS)
  string(REPLACE ";" "|" value "${${var}}")
  list(APPEND kda_consumer_common_args "-DKDA_${var}=${value}")
endforeach()

# Each test's arguments: the toolkit for the runner, the project's configure arguments ('|'-separated).
set(kda_cuda_args)
if(KDA_WITH_CUDA)
  # The installed package looks for CUDAToolkit: point it at the toolkit we built with.
  get_filename_component(kda_cuda_root "${CUDAToolkit_BIN_DIR}" DIRECTORY)
  set(kda_cuda_args
    "-DKDA_CUDA_COMPILER=${CMAKE_CUDA_COMPILER}" "-DKDA_CUDAToolkit_ROOT=${kda_cuda_root}")
endif()
set(kda_consumer_cuda_args ${kda_cuda_args}
  "-DKDA_CONSUMER_CONFIGURE_ARGS=-DKDA_EXPECT_CUDA=${KDA_WITH_CUDA}")
set(kda_readme_configure_args "-DKDA_README=${PROJECT_SOURCE_DIR}/README.md")
string(APPEND kda_readme_configure_args "|-DKDA_EXAMPLES_WORKING_DIR=${PROJECT_SOURCE_DIR}")
set(kda_readme_cuda_args)
if(NOT KDA_WITH_CUDA OR TARGET kda_cpu)
  # Without CUDAToolkit (also in a CUDA build): the CPU-only libraries.
  string(APPEND kda_readme_configure_args
    "|-DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON|-DKDA_EXPECT_CUDA=OFF")
else()
  set(kda_readme_cuda_args ${kda_cuda_args})  # KDA_CPU_LIBRARIES=OFF: the CUDA libraries only
endif()

add_test(NAME consumer_find_package
  COMMAND ${CMAKE_COMMAND} ${kda_consumer_common_args} ${kda_consumer_cuda_args}
    -DKDA_CONSUMER_SOURCE_DIR=${CMAKE_CURRENT_LIST_DIR}
    -DKDA_CONSUMER_WORK_DIR=${CMAKE_CURRENT_BINARY_DIR}/consumer
    -P ${CMAKE_CURRENT_LIST_DIR}/run_consumer.cmake)
set_tests_properties(consumer_find_package PROPERTIES LABELS cpu TIMEOUT 600)

get_filename_component(kda_readme_project "${CMAKE_CURRENT_LIST_DIR}/../readme" ABSOLUTE)
add_test(NAME readme_examples
  COMMAND ${CMAKE_COMMAND} ${kda_consumer_common_args} ${kda_readme_cuda_args}
    -DKDA_CONSUMER_SOURCE_DIR=${kda_readme_project}
    -DKDA_CONSUMER_WORK_DIR=${CMAKE_CURRENT_BINARY_DIR}/readme
    -DKDA_CONSUMER_RUN_CTEST=ON
    "-DKDA_CONSUMER_CONFIGURE_ARGS=${kda_readme_configure_args}"
    -P ${CMAKE_CURRENT_LIST_DIR}/run_consumer.cmake)
set_tests_properties(readme_examples PROPERTIES LABELS cpu TIMEOUT 600)
unset(kda_consumer_common_args)
unset(kda_consumer_cuda_args)
unset(kda_cuda_args)
unset(kda_readme_cuda_args)
unset(kda_readme_configure_args)
unset(kda_readme_project)
