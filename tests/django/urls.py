"""The admin, for the browser test of the records' ModelAdmin."""

from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
