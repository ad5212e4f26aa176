# Runs inside `cmake --install` (see CMakeLists.txt): configures the systemd
# unit templates with the install-time prefix and installs them.
#
# In:  CMAKE_INSTALL_PREFIX (the prefix of this install: --prefix or the
#      configured one), DEDE_UNIT_TEMPLATES (*.in files), DEDE_UNIT_WORK_DIR
#      (scratch in the build tree), DEDE_UNIT_DIR, DEDE_BINDIR, DEDE_DOCDIR
#      (each relative to the prefix, or absolute), DEDE_CONFIG_DIR.
# The templates use @bindir@, @DEDE_DOC_DIR@ and @DEDE_CONFIG_DIR@.
# file(INSTALL) honours DESTDIR (staging) and the install manifest; the
# paths written into the units never contain DESTDIR.

function(dede_under_prefix out dir)
  if(IS_ABSOLUTE "${dir}")
    set(path "${dir}")
  else()
    set(path "${CMAKE_INSTALL_PREFIX}/${dir}")
  endif()
  cmake_path(SET path NORMALIZE "${path}")
  string(REGEX REPLACE "(.)/$" "\\1" path "${path}")
  set(${out} "${path}" PARENT_SCOPE)
endfunction()

dede_under_prefix(bindir "${DEDE_BINDIR}")
dede_under_prefix(DEDE_DOC_DIR "${DEDE_DOCDIR}")
dede_under_prefix(unit_dir "${DEDE_UNIT_DIR}")
if(NOT IS_ABSOLUTE "${bindir}")
  message(FATAL_ERROR "dede: the systemd units need an absolute bindir, got '${bindir}' "
                      "(install with an absolute --prefix)")
endif()

# One scratch directory per prefix: two installs of one build tree to
# different prefixes at once do not overwrite each other's units.
string(MD5 prefix_tag "${CMAKE_INSTALL_PREFIX}")
set(work "${DEDE_UNIT_WORK_DIR}/${prefix_tag}")
set(units)
foreach(template IN LISTS DEDE_UNIT_TEMPLATES)
  get_filename_component(name "${template}" NAME)
  string(REGEX REPLACE "\\.in$" "" name "${name}")
  configure_file("${template}" "${work}/${name}" @ONLY)
  list(APPEND units "${work}/${name}")
endforeach()

file(INSTALL DESTINATION "${unit_dir}" TYPE FILE
     PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ
     FILES ${units})
