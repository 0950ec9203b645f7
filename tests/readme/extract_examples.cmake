# kda_extract_markdown_examples(<out_dir> <names_var> <markdown>...)
#
# Writes every fenced ```c / ```cpp block of each <markdown> file that is preceded by a marker line
#   <!-- test: NAME -->
# to <out_dir>/NAME.c or NAME.cpp, with a #line directive so that compiler messages point into the
# markdown file. Sets <names_var> to the list of NAME.c / NAME.cpp written. Fails (FATAL_ERROR) when
# a marker is not followed by a c/cpp block, when a name repeats (in one file or across files), when
# a c/cpp block has no marker, and when no file holds an example: every C and C++ example of the
# documentation is tested, so none can silently go stale. A file without any c/cpp block is fine.
#
# The markdown is handled as one string (not a CMake list): C code is full of ';'.
function(kda_extract_markdown_examples out_dir names_var)
  set(names)
  file(MAKE_DIRECTORY "${out_dir}")
  foreach(markdown IN LISTS ARGN)
    file(READ "${markdown}" text)
    set(marker "<!-- test: ")
    set(position 0)
    set(blocks 0)
    while(TRUE)
      string(SUBSTRING "${text}" ${position} -1 rest)
      string(FIND "${rest}" "${marker}" found)
      if(found EQUAL -1)
        break()
      endif()
      math(EXPR marker_at "${position} + ${found}")
      string(SUBSTRING "${text}" 0 ${marker_at} before)
      string(REGEX MATCHALL "\n" newlines "${before}")
      list(LENGTH newlines marker_line)
      math(EXPR marker_line "${marker_line} + 1")

      # <!-- test: NAME -->\n```LANG\n ... \n```
      string(SUBSTRING "${text}" ${marker_at} -1 rest)
      if(NOT rest MATCHES "^<!-- test: ([A-Za-z0-9_-]+) -->\n```(c|cpp)\n")
        message(FATAL_ERROR "${markdown}:${marker_line}: a '<!-- test: NAME -->' line must be "
                            "followed directly by a ```c or ```cpp block")
      endif()
      set(name "${CMAKE_MATCH_1}")
      set(language "${CMAKE_MATCH_2}")
      string(LENGTH "${CMAKE_MATCH_0}" header_length)
      string(SUBSTRING "${rest}" ${header_length} -1 body)
      string(FIND "${body}" "\n```" body_end)
      if(body_end EQUAL -1)
        message(FATAL_ERROR "${markdown}:${marker_line}: the block of '${name}' is not closed")
      endif()
      string(SUBSTRING "${body}" 0 ${body_end} code)
      if("${name}.${language}" IN_LIST names)
        message(FATAL_ERROR "${markdown}:${marker_line}: example name '${name}' is used twice")
      endif()
      math(EXPR code_line "${marker_line} + 2")
      file(WRITE "${out_dir}/${name}.${language}" "#line ${code_line} \"${markdown}\"\n${code}\n")
      list(APPEND names "${name}.${language}")
      math(EXPR blocks "${blocks} + 1")
      math(EXPR position "${marker_at} + ${header_length} + ${body_end}")
    endwhile()

    # Every c/cpp block of the file must have been one of the marked ones.
    string(REGEX MATCHALL "\n```(c|cpp)\n" fences "\n${text}")
    list(LENGTH fences fence_count)
    if(NOT fence_count EQUAL blocks)
      message(FATAL_ERROR "${markdown}: ${fence_count} ```c / ```cpp blocks but ${blocks} marked "
                          "'<!-- test: NAME -->': mark every C and C++ example so that it is tested")
    endif()
  endforeach()
  if(NOT names)
    message(FATAL_ERROR "no '<!-- test: NAME -->' example found in: ${ARGN}")
  endif()
  set(${names_var} "${names}" PARENT_SCOPE)
endfunction()
