from django.core.exceptions import ImproperlyConfigured
from rest_framework.pagination import PageNumberPagination


class OrderedPageNumberPagination(PageNumberPagination):
    """Page-number pagination that refuses unordered querysets: without an order, rows can repeat or
    vanish between pages."""

    page_size_query_param = "page_size"
    max_page_size = 500

    def paginate_queryset(self, queryset, request, view=None):
        if hasattr(queryset, "ordered") and not queryset.ordered:
            raise ImproperlyConfigured(
                f"{view.__class__.__name__} paginates an unordered queryset; add an ordering."
            )
        return super().paginate_queryset(queryset, request, view)
